"""Every Triton kernel of the package compiles for the H200 (sm_90a) at the shapes it runs there, without a GPU:
Triton's own compiler down to PTX, then the ptxas that ships with Triton, with register spills reported.

The interpreter tests (``TRITON_INTERPRET=1``) prove what the kernels compute; this proves the real compiler takes
them (a kernel the interpreter runs can still fail to lower), so a kernel changed on a machine without a GPU is
known to build before a GPU session spends time on it. Marked ``gpu`` + ``triton`` like the other kernel tests
(CI runs them under the interpreter, where this one compiles in a subprocess without it); runs on the CPU with
``python -m pytest -m triton tests/`` (README Notes), and on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import TRITON_MARKS  # noqa: E402

pytestmark = TRITON_MARKS

GREEDY_ARGS = {
    "cover_ptr": "*fp32", "cover_t_ptr": "*fp32", "scales_ptr": "*fp32", "gain_ptr": "*i64", "best_ptr": "*fp32",
    "taken_ptr": "*i8", "order_ptr": "*i64", "proposals_ptr": "*i64",
    "fail_ptr": "*i32", "scratch_rows_ptr": "*i32", "scratch_old_ptr": "*fp32", "scratch_new_ptr": "*fp32",
    "phases_ptr": "*i64",
}
ATTENTION_ARGS = {"Q": "*bf16", "K": "*bf16", "SEG_START": "*i32", "SEG_STOP": "*i32", "LSE": "*fp32",
                  "OUT": "*fp32", "qk_scale": "fp32"}
LATE_ARGS = dict(GREEDY_ARGS, best_copy_ptr="*fp32", list_rows_ptr="*i32", list_vals_ptr="*fp32",
                 list_len_ptr="*i32")
LISTS_ARGS = {"cover_t_ptr": "*fp32", "best_ptr": "*fp32", "list_rows_ptr": "*i32", "list_vals_ptr": "*fp32",
              "list_len_ptr": "*i32"}
PREPARE_ARGS = {"cover_ptr": "*fp32", "scales_ptr": "*fp32", "cover_t_ptr": "*fp32", "gain_ptr": "*i64"}
SOFTMAX_ARGS = {"scores_ptr": "*bf16", "visible_ptr": "*i1", "out_ptr": "*bf16"}
JOIN_ARGS = {"state_ptr": "*fp32", "old_ptr": "*fp32", "new_ptr": "*fp32"}
#: a Qwen3.5-9B GDN layer's join (K = V = 128; `join_triton.launch_join_prefix`'s tiling)
JOIN_128 = dict(ROWS=128, BLOCK_V=32, BLOCK_K=32, PRECISION="tf32x3")
CHUNK_ARGS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
              "h0_ptr": "*fp32", "o_ptr": "*bf16", "ht_ptr": "*fp32", "pending_ptr": "*fp32", "live_ptr": "*fp32",
              "lo_ptr": "*bf16", "scale": "fp32"}
#: a Qwen3.5-9B GDN window (K = 128; `chunk_triton.chunk_gated_delta`'s defaults); ``LAZY``: a batch-1 compiled
#: fused step's (`chunk_triton.lazy_window_`)
CHUNK_128 = dict(KEY_DIM=128, BT=64, BLOCK_V=32, LEVELS=6, EPS=1e-6, CARRY=0, LAZY=False)
DIVPRUNE_ARGS = {"sim_ptr": "*fp32", "nearest_ptr": "*fp32", "order_ptr": "*i64"}
#: MMTok at 4096 tokens (`coverage_plan`: 64 programs of 64 columns, 8 warps; 24 question rows -> 32)
MMTOK_4096 = dict(SPLITS=64, SPLITS_P2=64, BLOCK_C=64, BLOCK_M=32, BLOCK_N=4096, TILE_R=64, SPIN=1 << 22,
                  PHASES=False)

MMTOK_LATE = dict(BLOCK_M=32, BLOCK_N=4096, LIST=64, BLOCK_R=1024, SPIN=1 << 22)


def compile_for_hopper(kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int = 3):
    """``triton.compile`` of `kernel` for sm_90a: pointer and float arguments typed by `types`, the others i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_report(compiled, tmp_path) -> str:
    """ptxas ``-v`` on the kernel's PTX, with the ptxas Triton compiled it with (its own, or ``TRITON_PTXAS_PATH``:
    the PTX version it writes follows that one): its register and spill lines."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(compiled.asm["ptx"])
    run = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(tmp_path / "kernel.cubin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return "\n".join(line for line in (run.stdout + run.stderr).splitlines() if "registers" in line or "spill" in line)


SPLIT_KEYS_ARGS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "vis_ptr": "*i1", "acc_ptr": "*fp32",
                   "max_ptr": "*fp32", "sum_ptr": "*fp32", "out_ptr": "*bf16", "scale": "fp64"}


def kernels():
    from hf_raincheck.attention import softmax_triton, split_keys_triton
    from hf_raincheck.gdn_state import chunk_triton, join_triton
    from hf_raincheck.pruning import attention_triton, greedy_triton

    cases = {
        "mmtok-4096": (greedy_triton._coverage_kernel, GREEDY_ARGS, MMTOK_4096, 8),
        "mmtok-4096-phases": (greedy_triton._coverage_kernel, GREEDY_ARGS, dict(MMTOK_4096, PHASES=True), 8),
        "mmtok-video": (greedy_triton._coverage_kernel, GREEDY_ARGS,
                        dict(MMTOK_4096, SPLITS=8, SPLITS_P2=8, BLOCK_C=32, BLOCK_N=256, TILE_R=64), 4),
        # the late stage at 4096 tokens (`coverage_stages`' default: 8 programs of 512 columns), its lists, and
        # the late stage on one program (no barrier)
        "mmtok-late": (greedy_triton._coverage_late_kernel, LATE_ARGS,
                       dict(MMTOK_LATE, SPLITS=8, SPLITS_P2=8, BLOCK_C=512, TILE_R=8), 8),
        "mmtok-late-one-program": (greedy_triton._coverage_late_kernel, LATE_ARGS,
                                   dict(MMTOK_LATE, SPLITS=1, SPLITS_P2=2, BLOCK_C=4096, TILE_R=1), 8),
        "mmtok-lists": (greedy_triton._raising_rows_kernel, LISTS_ARGS, dict(LIST=64, BLOCK_R=1024), 4),
        "mmtok-prepare": (greedy_triton._prepare_kernel, PREPARE_ARGS, dict(BLOCK_R=64, BLOCK_C=64), 4),
        "divprune-4096": (greedy_triton._divprune_kernel, DIVPRUNE_ARGS, dict(BLOCK_N=4096), 8),
        # a fused step's grouped softmax at 4352 keys (one pass), and the two-pass kernel of longer rows
        "grouped-softmax-4352": (softmax_triton._masked_softmax_kernel, SOFTMAX_ARGS,
                                 dict(BLOCK_K=8192, ONE_PASS=True), 16),
        "grouped-softmax-long": (softmax_triton._masked_softmax_kernel, SOFTMAX_ARGS,
                                 dict(BLOCK_K=2048, ONE_PASS=False), 4),
        # a compiled Qwen3-VL-8B fused step's attention (head dim 128, 32 rows x 4 query heads per KV head; Inductor
        # passes the scale as fp64), and the combine of its 16 key ranges
        "split-keys-128": (split_keys_triton._partial_kernel, SPLIT_KEYS_ARGS,
                           dict(HEAD_DIM=128, BLOCK_M=split_keys_triton.BLOCK_M, BLOCK_N=split_keys_triton.BLOCK_N),
                           split_keys_triton.WARPS),
        "split-keys-combine": (split_keys_triton._combine_kernel, SPLIT_KEYS_ARGS, dict(HEAD_DIM=128, SPLITS=16), 4),
        "gdn-join-128": (join_triton._join_prefix_kernel, JOIN_ARGS, JOIN_128, 8),
        "gdn-chunk-128": (chunk_triton._chunk_kernel, CHUNK_ARGS, CHUNK_128, chunk_triton.WARPS),
        "gdn-chunk-128-lazy": (chunk_triton._chunk_kernel, CHUNK_ARGS, dict(CHUNK_128, LAZY=True), chunk_triton.WARPS),
        # the batches' launch: 64 V columns per program (`chunk_triton.WIDE_BLOCK_V`)
        "gdn-chunk-128-wide": (chunk_triton._chunk_kernel, CHUNK_ARGS,
                               dict(CHUNK_128, BLOCK_V=chunk_triton.WIDE_BLOCK_V), chunk_triton.WARPS),
    }
    for kind in ("lse", "received"):
        block_m, block_n, warps, stages = attention_triton.CONFIGS[(kind, "16bit")]
        kernel = attention_triton._lse_kernel if kind == "lse" else attention_triton._received_kernel
        head = dict(D=72, D0=64, D1=16, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=False)  # Qwen3-VL's ViT heads
        cases[f"attention-{kind}"] = (kernel, ATTENTION_ARGS, head, warps)
    return cases


def compile_case(case: str, tmp_path) -> str:
    """Compiles one case (`kernels`) and returns ptxas' report."""
    kernel, types, constexprs, warps = kernels()[case]
    compiled = compile_for_hopper(kernel, types, constexprs, warps)
    assert compiled.asm["ptx"] and compiled.asm["cubin"]
    return ptxas_report(compiled, tmp_path)


@pytest.mark.parametrize("case", ["mmtok-4096", "mmtok-4096-phases", "mmtok-video", "mmtok-late", "mmtok-late-one-program",
                                  "mmtok-lists", "mmtok-prepare",
                                  "divprune-4096", "grouped-softmax-4352",
                                  "grouped-softmax-long", "split-keys-128", "split-keys-combine", "gdn-join-128", "gdn-chunk-128",
                                  "gdn-chunk-128-lazy", "gdn-chunk-128-wide",
                                  "attention-lse",
                                  "attention-received"])
def test_kernel_compiles_for_hopper(case, tmp_path):
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels are interpreted functions here: compile elsewhere
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        run = subprocess.run([sys.executable, __file__, case, str(tmp_path)], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
        report = run.stdout
    else:
        report = compile_case(case, tmp_path)
    print(f"\n{case}: {report}")
    assert "registers" in report


if __name__ == "__main__":  # one case, in a process without the interpreter (see the test)
    from pathlib import Path

    print(compile_case(sys.argv[1], Path(sys.argv[2])))
