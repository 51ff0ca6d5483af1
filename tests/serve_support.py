"""Helpers of the server tests (tests/test_serve*.py): images as data URLs / files, dialogues, references."""

from __future__ import annotations

import base64
import io

from hf_raincheck import RaincheckChat, RaincheckConfig, enable_raincheck
from hf_raincheck.gridqa import make_dialogue


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def user(text: str, image_url: str | None = None) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image_url}}] if image_url else []
    return {"role": "user", "content": content + [{"type": "text", "text": text}]}


def gridqa_images(indices):
    return {i: make_dialogue(i).image() for i in indices}


def chat_reference(model, processor, config: RaincheckConfig, turns, max_new_tokens: int) -> list[str]:
    """Answers of `RaincheckChat` (greedy) to ``turns``: ``(text, PIL image or None)`` pairs."""
    with RaincheckChat(model, processor, config, max_new_tokens=max_new_tokens, do_sample=False) as chat:
        return [chat.ask(text, images=image) for text, image in turns]


def plain_answer(model, processor, messages: list[dict], max_new_tokens: int, raincheck_config=None):
    """Greedy `generate` on the whole chat rendered by the template (plain, or Raincheck on a fresh cache)."""
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    kwargs = {}
    if raincheck_config is not None:
        enable_raincheck(model)  # idempotent: the reference model may not have run a RaincheckChat yet
        kwargs["raincheck_config"] = raincheck_config
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    out = out.sequences if hasattr(out, "sequences") else out
    ids = inputs["input_ids"][0]
    return processor.decode(out[0, ids.numel():], skip_special_tokens=True), ids


def processor_messages(messages: list[dict], images_by_url: dict) -> list[dict]:
    """The OpenAI messages of a test as the processor's messages (PIL images), for the references."""
    result = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for part in content:
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
            else:
                parts.append({"type": "image", "image": images_by_url[part["image_url"]["url"]]})
        result.append({"role": message["role"], "content": parts})
    return result


def ask_openai(client, model: str, messages: list[dict], max_tokens: int, stream: bool = False, **kwargs):
    """``(answer, usage)`` of one greedy chat completion through the openai client (streamed: the pieces joined,
    the usage of the last chunk that has one)."""
    if not stream:
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, **kwargs)
        return response.choices[0].message.content, response.usage
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, max_tokens=max_tokens,
                                                temperature=0, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return "".join(pieces), usage
