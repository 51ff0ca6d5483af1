"""Fast training batches for GridQA, equal to what the processor and chat template produce (tests check it).

* :func:`encode_dialogue`: the token ids of a whole dialogue as the chat template renders it (answers included), and
  the label mask (answer tokens and the ``<|im_end|>`` that closes each answer).
* :class:`PixelAtlas`: ``pixel_values`` of grid images straight from the cell ids: every cell is one merged token,
  i.e. 2 x 2 patches of the Qwen2-VL patch layout, so a grid's ``pixel_values`` is a gather of per-cell rows.
* :func:`mrope_positions`: the ``[3, B, L]`` M-RoPE positions of such sequences (one 8 x 8 image after the same 4
  tokens in every dialogue), equal to the model's ``get_rope_index``.
* :func:`batched_vision_attention`: a context manager that makes the vision towers' attention one SDPA call over all
  images of a batch (same grid each) instead of transformers' per-image loop; the same math, for training speed.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from . import task

PATCH = 16
MERGE = 2
TEMPORAL = 2
IMAGE_TOKENS = task.GRID * task.GRID  # 64
PATCHES = IMAGE_TOKENS * MERGE * MERGE  # 256
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH  # 1536

#: text before the first image placeholder: <|im_start|> user \n <|vision_start|>
PREFIX_LEN = 4


class DialogueEncoder:
    """Token ids of dialogues (``chat_template`` rendering of ``Dialogue.messages()``), with a label mask."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        self.first_head = enc("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * IMAGE_TOKENS + "<|vision_end|>")
        self.user_head = enc("<|im_start|>user\n")
        self.assistant_head = enc("<|im_end|>\n<|im_start|>assistant\n")
        self.end = enc("<|im_end|>")
        self.newline = enc("\n")
        assert len(self.first_head) == PREFIX_LEN + IMAGE_TOKENS + 1
        self.pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def encode(self, dialogue_or_turns, answers: list[str] | None = None):
        """``(ids, labels)``: lists of ints / bools. ``answers`` overrides the turns' answers."""
        return self.encode_many([dialogue_or_turns], None if answers is None else [answers])[0]

    def encode_many(self, dialogues, answers=None):
        texts = []
        for i, d in enumerate(dialogues):
            turns = d.turns if isinstance(d, task.Dialogue) else d
            for j, t in enumerate(turns):
                texts.append(t.question)
                texts.append(t.answer if answers is None else answers[i][j])
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        out = []
        k = 0
        for d in dialogues:
            turns = d.turns if isinstance(d, task.Dialogue) else d
            ids: list[int] = []
            labels: list[bool] = []
            for j in range(len(turns)):
                q, a = encoded[k], encoded[k + 1]
                k += 2
                head = (self.first_head if j == 0 else self.user_head) + q + self.assistant_head
                ids += head
                labels += [False] * len(head)
                ids += a + self.end
                labels += [True] * (len(a) + len(self.end))
                ids += self.newline
                labels += [False] * len(self.newline)
            out.append((ids, labels))
        return out

    def batch(self, dialogues):
        """Right-padded ``input_ids`` ``[B, L]`` (pad ``<|endoftext|>``) and ``labels`` ``[B, L]`` (bool)."""
        pairs = self.encode_many(dialogues)
        length = max(len(ids) for ids, _ in pairs)
        input_ids = np.full((len(pairs), length), self.pad_id, dtype=np.int64)
        labels = np.zeros((len(pairs), length), dtype=bool)
        for i, (ids, lab) in enumerate(pairs):
            input_ids[i, : len(ids)] = ids
            labels[i, : len(lab)] = lab
        return input_ids, labels


def cell_patch_rows(mean: float = 0.5, std: float = 0.5) -> np.ndarray:
    """``float32 [NUM_CELL_IDS, 4, 1536]``: the 4 ``pixel_values`` rows (Qwen2-VL patch layout) of every cell sprite."""
    atlas = task.sprite_atlas().astype(np.float32) / 255.0  # [N, 32, 32, 3]
    atlas = (atlas - mean) / std
    x = atlas.transpose(0, 3, 1, 2)  # [N, C, 32, 32]
    n = x.shape[0]
    # [N, C, mh, py, mw, px] -> [N, mh, mw, C, py, px]
    x = x.reshape(n, 3, MERGE, PATCH, MERGE, PATCH).transpose(0, 2, 4, 1, 3, 5)
    # temporal axis: an image is repeated over temporal_patch_size frames -> (C, T, py, px)
    x = np.repeat(x[:, :, :, :, None], TEMPORAL, axis=4)
    return np.ascontiguousarray(x.reshape(n, MERGE * MERGE, PATCH_DIM))


class PixelAtlas:
    """``pixel_values`` / ``image_grid_thw`` of grid images from their cell ids, on any device."""

    def __init__(self, device="cpu", dtype=torch.float32):
        self.rows = torch.from_numpy(cell_patch_rows()).to(device, dtype)
        self.device = device

    def __call__(self, cells):
        cells = torch.as_tensor(np.asarray(cells), device=self.device).reshape(-1, IMAGE_TOKENS)
        pixel_values = self.rows[cells].reshape(-1, PATCH_DIM)  # [B * 64 * 4, 1536]: cells raster, 2x2 inside
        grid = torch.tensor([[1, task.GRID * MERGE, task.GRID * MERGE]], device=self.device).repeat(cells.shape[0], 1)
        return pixel_values, grid


def mrope_positions(batch: int, length: int, device="cpu") -> torch.Tensor:
    """``[3, batch, length]`` M-RoPE positions (T, H, W) of dialogues whose one image starts at index 4."""
    idx = torch.arange(length, device=device)
    pos = idx.clone()
    start, end = PREFIX_LEN, PREFIX_LEN + IMAGE_TOKENS
    k = idx[start:end] - start
    t = torch.stack([pos, pos, pos])
    t[0, start:end] = start
    t[1, start:end] = start + k // task.GRID
    t[2, start:end] = start + k % task.GRID
    t[:, end:] = idx[end:] - IMAGE_TOKENS + task.GRID
    return t[:, None, :].expand(3, batch, length)


def _batched_forward(module, rotary):
    def forward(hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
        seq = hidden_states.shape[0]
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        n = lengths.numel()
        per = seq // n
        q, k, v = module.qkv(hidden_states).reshape(seq, 3, module.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = rotary(q, k, cos, sin)
        q, k, v = (x.reshape(n, per, module.num_heads, -1).transpose(1, 2) for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=module.scaling)
        out = out.transpose(1, 2).reshape(seq, -1)
        return module.proj(out)

    return forward


@contextlib.contextmanager
def batched_vision_attention(model):
    """Inside: the vision attention of ``model`` runs one SDPA over ``[images, heads, 256, d]`` (all images must have
    the same number of patches). Restores the original forwards on exit."""
    import importlib

    patched = []
    for module in model.modules():
        name = type(module).__name__
        if name in ("Qwen3VLVisionAttention", "Qwen3_5VisionAttention"):
            mod = importlib.import_module(type(module).__module__)
            patched.append(module)
            module.forward = _batched_forward(module, mod.apply_rotary_pos_emb_vision)
    try:
        yield model
    finally:
        for module in patched:
            del module.forward

