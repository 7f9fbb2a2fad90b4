"""The GGUF writer, its vocabulary and the Ollama Modelfile beside it.
Imports qlora_cli.core and sources; the gguf package is the optional `gguf` extra."""
