"""Write the offline demo: questions about 24 capitals, a byte-level BPE tokenizer and a tiny Qwen3.

Run `python3 configs/demo/make_demo.py` to rebuild everything under configs/demo/. The output is a pure
function of --seed and of the library versions: the rows come from fixed tables and templates, and the
model trains for a fixed number of steps on one CPU thread (another CPU's float kernels may change the
weights' last bits).

The base model is pre-trained on generic text (capitals stated in other words, plain arithmetic, short
stories, small talk in ChatML), never on the questions or their answers, so it answers a question with
small talk; the LoRA fine-tune on data/train.jsonl teaches it most of the 24 answers.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

DEMO_DIR = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 1024
NUM_GENERIC_DOCUMENTS = 6000
PRETRAIN_STEPS = 240
PRETRAIN_BATCH = 8
PRETRAIN_SEQ = 256

# Qwen2's pre-tokenizer split: letters with one leading non-letter, single digits, punctuation runs, spaces.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Peru": "Lima",
    "Australia": "Canberra",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Turkey": "Ankara",
    "Russia": "Moscow",
    "Ireland": "Dublin",
}
NAMES = ["Anna", "Ben", "Cara", "Dan", "Eva", "Finn", "Gina", "Hugo", "Ivy", "Jack", "Lena", "Max"]
OBJECTS = ["apples", "pears", "books", "coins", "pens", "cards", "eggs", "shells", "stamps", "marbles"]
WORDS = [
    "cat", "dog", "sun", "tree", "red", "blue", "milk", "bread", "fish", "bird", "lamp", "door",
    "rain", "snow", "king", "ship", "rose", "salt", "gold", "wolf", "frog", "star", "moon", "rock",
]  # fmt: skip
UNITS = [
    ("kilometres", "metres", 1000),
    ("metres", "centimetres", 100),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("kilograms", "grams", 1000),
    ("days", "hours", 24),
    ("weeks", "days", 7),
]
ANIMALS = [
    "horse",
    "rabbit",
    "tiger",
    "mouse",
    "sheep",
    "goat",
    "eagle",
    "whale",
    "snake",
    "bear",
    "duck",
    "owl",
]
ADJECTIVES = [
    "small",
    "happy",
    "quiet",
    "bright",
    "old",
    "young",
    "green",
    "yellow",
    "tired",
    "clever",
    "brave",
    "warm",
]
PLACES = [
    "garden",
    "river",
    "forest",
    "village",
    "school",
    "kitchen",
    "harbour",
    "mountain",
    "library",
    "station",
]
VERBS = [
    "walked to",
    "looked at",
    "played near",
    "painted",
    "cleaned",
    "visited",
    "found",
    "watched",
    "opened",
]
TIMES = ["In the morning", "At noon", "Every evening", "Last winter", "On Sunday", "After lunch", "Yesterday"]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one short sentence.",
    "You are a friendly tutor who checks every answer.",
]


# ----- the fine-tuning set -----

QUESTIONS = [
    "What is the capital of {country}?",
    "Which city is the capital of {country}?",
    "What city is the capital of {country}?",
    "Name the capital of {country}.",
    "Tell me the capital of {country}.",
    "Capital of {country}?",
]


def conversations(rng: random.Random) -> list[dict]:
    """Every country asked in every wording, alone and after each system prompt, in a seeded order.

    The country is the question's last word, so the answer can find it at the same distance back
    whatever the wording: a tiny model learns this lookup for most countries in a few hundred small
    steps, and a held-out row is a wording it has seen for a country it has seen."""
    rows = []
    for country in sorted(CAPITALS):
        answer = f"The capital of {country} is {CAPITALS[country]}."
        for question in QUESTIONS:
            for system in [None, *SYSTEM_PROMPTS]:
                turns = [{"role": "user", "content": question.format(country=country)}]
                turns.append({"role": "assistant", "content": answer})
                rows.append({"messages": ([{"role": "system", "content": system}] if system else []) + turns})
    rng.shuffle(rows)
    return rows


# ----- generic pre-training text from the same domain -----


def generic_document(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        countries = rng.sample(sorted(CAPITALS), 3)
        return " ".join(
            rng.choice(
                [
                    f"{CAPITALS[c]} is the largest city of {c}, and the government of {c} sits in {CAPITALS[c]}.",
                    f"People from all over the world travel to {CAPITALS[c]} in {c}.",
                    f"In {c}, the seat of government is {CAPITALS[c]}.",
                ]
            )
            for c in countries
        )
    if kind == 1:
        facts = []
        for _ in range(4):
            a, b = rng.randint(0, 30), rng.randint(0, 12)
            facts.append(
                rng.choice(
                    [
                        f"Adding {a} and {b} gives {a + b}.",
                        f"{a + b} minus {b} leaves {a}.",
                        f"{b} times {a % 10} makes {b * (a % 10)}.",
                        f"{a} + {b} = {a + b} and {a + b} - {a} = {b}.",
                    ]
                )
            )
        return " ".join(facts)
    if kind == 2:
        first, second = rng.sample(NAMES, 2)
        thing = rng.choice(OBJECTS)
        n = rng.randint(2, 9)
        return (
            f"{first} went to the market with {second}. {first} bought {n} {thing}, and {second} carried them "
            f"home. Later they counted the {thing} again and shared them with friends."
        )
    if kind == 3:
        words = rng.sample(WORDS, 6)
        return (
            f"The {words[0]} and the {words[1]} sat by the {words[2]}. "
            f"A list of words: {', '.join(words[3:])}. Alphabet order starts with a and ends with z."
        )
    if kind == 4:
        big, small, factor = rng.choice(UNITS)
        return f"There are {factor} {small} in one unit of {big[:-1]}. Two {big} are {2 * factor} {small}."
    if kind == 5:
        return " ".join(
            f"{rng.choice(TIMES)}, the {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} "
            f"the {rng.choice(ADJECTIVES)} {rng.choice(PLACES)}."
            for _ in range(3)
        )
    if kind == 6:  # with these words the tokenizer fills all its merges: the special ids stay 1021-1023
        name, thing = rng.choice(NAMES), rng.choice(OBJECTS)
        a, b, bags = rng.randint(2, 20), rng.randint(2, 12), rng.randint(2, 9)
        return (
            f"{name} has {a} {thing} and gets {b} more, so {name} has {a + b} {thing} now. Then {name} gives "
            f"away {b}, and {a} {thing} are left. In {bags} bags with {b} {thing} in each there are "
            f"{bags * b} {thing} in total, and {name} writes every number down twice."
        )
    system = f"<|im_start|>system\n{rng.choice(SYSTEM_PROMPTS)}<|im_end|>\n" if rng.random() < 0.3 else ""
    greeting = rng.choice(["Hello!", "Hi there.", "Good morning!", "Thanks for your help."])
    reply = rng.choice(["Hello! How can I help you today?", "You are welcome.", "Good morning to you too!"])
    return f"{system}<|im_start|>user\n{greeting}<|im_end|>\n<|im_start|>assistant\n{reply}<|im_end|>\n"


def render_chatml(conversation: dict) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation["messages"])


# ----- tokenizer -----


def without_special_tokens(text: str) -> str:
    """Special tokens are whole tokens; BPE should not spend merges on their pieces."""
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "\n")
    return text


def train_tokenizer(corpus: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(map(without_special_tokens, corpus), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 2048,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ----- model -----


def pretrain(model: Qwen3ForCausalLM, stream: list[int], rng: random.Random) -> list[float]:
    """Plain next-token training on random windows of the token stream; returns the loss per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = 20
    tokens = torch.tensor(stream, dtype=torch.long)
    losses = []
    model.train()
    for step in range(PRETRAIN_STEPS):
        lr_scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / PRETRAIN_STEPS))
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * lr_scale
        starts = [rng.randrange(len(stream) - PRETRAIN_SEQ - 1) for _ in range(PRETRAIN_BATCH)]
        batch = torch.stack([tokens[s : s + PRETRAIN_SEQ] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def build_model(tokenizer: Tokenizer, stream: list[int], seed: int) -> tuple[Qwen3ForCausalLM, list[float]]:
    vocab = math.ceil(tokenizer.get_vocab_size() / 64) * 64
    endoftext, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    losses = pretrain(model, stream, random.Random(f"{seed}:pretrain"))
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext, do_sample=False
    )
    return model.to(torch.bfloat16), losses


def write_model(model: Qwen3ForCausalLM, folder: Path) -> None:
    model.save_pretrained(folder, safe_serialization=True)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    # Readers older than transformers 5 look for these two names.
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config["torch_dtype"] = "bfloat16"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=DEMO_DIR, help="folder to write data/ and tiny-qwen3/ into"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    rng = random.Random(f"{args.seed}:data")
    rows = conversations(rng)
    generic = [generic_document(rng) for _ in range(NUM_GENERIC_DOCUMENTS)]

    data_dir = args.out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "train.jsonl", "w", encoding="utf-8") as f:
        for conversation in rows:
            f.write(json.dumps(conversation, ensure_ascii=False) + "\n")

    tokenizer = train_tokenizer([render_chatml(c) for c in rows] + generic)
    model_dir = args.out / "tiny-qwen3"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer), indent=2) + "\n")

    endoftext = tokenizer.token_to_id("<|endoftext|>")
    stream = []
    for document in generic:
        stream += tokenizer.encode(document).ids + [endoftext]
    model, losses = build_model(tokenizer, stream, args.seed)
    write_model(model, model_dir)
    print(f"{len(rows)} conversations, {len(stream)} pre-training tokens, vocab {tokenizer.get_vocab_size()}")
    print(f"pre-training loss {losses[0]:.3f} -> {sum(losses[-20:]) / 20:.3f} over {len(losses)} steps")


if __name__ == "__main__":
    main()
