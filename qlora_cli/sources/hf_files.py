"""The file names of a Hugging Face model folder, the one home of each: what qlora reads from a base and
writes into a merged export."""

MODEL_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# What a fast tokenizer may come with; qlora reads the first, the config and the template.
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    CHAT_TEMPLATE_FILE,
)
# A vision-language model's image and video processors, copied beside a merged export.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
