"""A multi-turn chat with images against a running ``hf-raincheck serve``, through the `openai` client.

    hf-raincheck serve &                    # the shipped GridQA model on the CPU, http://127.0.0.1:8000
    python examples/serve_client.py         # three turns about a GridQA grid, streamed; Raincheck's usage per turn
    python examples/serve_client.py --base-url http://HOST:8000/v1 --model Qwen/Qwen3-VL-8B-Instruct --image photo.jpg

Each request sends the whole conversation (as any OpenAI client does); the server sees that it extends the
previous request's conversation and continues on that conversation's cache, so only the new message is prefilled.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def image_data_url(path: str | None) -> tuple[str, list[str]]:
    """The image as a data: URL, and questions about it (GridQA's for the default grid)."""
    if path is None:
        from hf_raincheck.gridqa import make_dialogue

        dialogue = make_dialogue(0)
        image, questions = dialogue.image(), [turn.question for turn in dialogue.turns]
    else:
        from PIL import Image

        image = Image.open(path).convert("RGB")
        questions = ["What is in the picture?", "What is in the top left corner?", "And in the bottom right?"]
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), questions


def main(argv=None) -> list[str]:
    import openai

    from hf_raincheck.serve import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--image", default=None, help="an image file (default: a GridQA grid)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key="unused")
    url, questions = image_data_url(args.image)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": questions[0]}]}]
    answers = []
    for turn, question in enumerate(questions):
        if turn:
            messages.append({"role": "user", "content": question})
        print(f"> {question}\n", end="", flush=True)
        pieces, usage = [], None
        for chunk in client.chat.completions.create(model=args.model, messages=messages, stream=True,
                                                    max_tokens=args.max_tokens, temperature=0):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                print(pieces[-1], end="", flush=True)
            usage = chunk.usage or usage
        answer = "".join(pieces)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
        rc = usage.raincheck
        print(f"\n  [{usage.prompt_tokens} prompt tokens, {usage.prompt_tokens_details.cached_tokens} from the "
              f"conversation's cache ({rc['conversation_cache']}); deferred {rc['deferred']}, restored: "
              f"{rc['restored_during_decode']} during the answer, {rc['previous_restored_after_answer']} after the "
              f"previous answer, {rc['restored_in_prefill']} in this prefill]\n")
    return answers


if __name__ == "__main__":
    main()
