"""llama.cpp (llama-cpp-python) on a GGUF file, in a process of its own, for tests/test_export_gguf.py: a
crash in its native code (an Illegal instruction from a build for another CPU) then fails the test that
asked, not the whole pytest session.

Reads one JSON request on stdin and writes the answer as JSON on stdout. The request names `model` (the
GGUF path) and `n_ctx`, and asks for any of: `tokenize` (texts, special tokens as text), `tokenize_special`
(texts, special tokens parsed), `generate` ({ids, max_tokens, stop}: greedy tokens until max_tokens or
the stop id, which is kept), `eval` (ids whose logits come back as `scores`, one row per id).
"""

import json
import sys

import llama_cpp


def main() -> None:
    request = json.load(sys.stdin)
    llama = llama_cpp.Llama(
        model_path=request["model"],
        n_ctx=request["n_ctx"],
        n_threads=2,
        logits_all="eval" in request,
        verbose=False,
    )
    answer = {
        "tokens": [
            llama.tokenize(text.encode(), add_bos=False, special=False)
            for text in request.get("tokenize", [])
        ],
        "special_tokens": [
            llama.tokenize(text.encode(), add_bos=False, special=True)
            for text in request.get("tokenize_special", [])
        ],
    }
    if "generate" in request:
        asked, generated = request["generate"], []
        for token in llama.generate(asked["ids"], temp=0.0, top_k=1, reset=True):
            generated.append(token)
            if len(generated) == asked["max_tokens"] or token == asked["stop"]:
                break
        answer["generated"] = generated
    if "eval" in request:
        llama.eval(request["eval"])
        answer["scores"] = llama.scores[: len(request["eval"])].tolist()
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
