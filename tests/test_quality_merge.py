"""``benchmarks/quality.py --save-results`` / ``--merge``: a grid run in parts (resumable, on several machines) and
merged summarises exactly like one run (the shipped GridQA Qwen3-VL on the CPU, 2 dialogues, ~20 s)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import quality  # noqa: E402

QUICK = ["--quick", "--selectors", "uniform"]


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """One plain run of dialogues 0-1, the same as two parts (the second through a worker process), and the merge."""
    tmp = tmp_path_factory.mktemp("quality")
    threads = torch.get_num_threads()
    try:
        assert quality.main(QUICK + ["--dialogues", "2", "--out", str(tmp / "a.json")]) == 0
        assert quality.main(QUICK + ["--start", "0", "--dialogues", "1", "--save-results", str(tmp / "p1.jsonl"),
                                     "--out", str(tmp / "p1.json")]) == 0
        assert quality.main(QUICK + ["--start", "1", "--dialogues", "1", "--save-results", str(tmp / "p2.jsonl"),
                                     "--jobs", "2", "--out", str(tmp / "p2.json")]) == 0
        merge = ["--merge", str(tmp / "p1.jsonl"), str(tmp / "p2.jsonl"), "--out", str(tmp / "m.json")]
        assert quality.main(merge) == 0
    finally:
        torch.set_num_threads(threads)
    return tmp


def test_merged_parts_summarise_like_one_run(parts):
    plain = json.loads((parts / "a.json").read_text())
    merged = json.loads((parts / "m.json").read_text())
    assert merged["records"] == plain["records"]
    run, whole = merged["runs"]["qwen3_vl"], plain["runs"]["qwen3_vl"]
    assert run["records"] == whole["records"] and run["restored_mean"] == whole["restored_mean"]
    assert run["seconds_per_dialogue"].keys() == whole["seconds_per_dialogue"].keys()
    meta = run["meta"]
    assert meta["dialogues"] == 2 and meta["start"] == 0 and meta["indices"] == [[0, 1]]
    assert meta["wall_s"] is None and meta["cpu_s"] > 0 and whole["meta"]["cpu_s"] > 0
    assert meta["bootstrap"] == whole["meta"]["bootstrap"] == 200
    for key in ("arch", "selectors", "retentions", "chunks", "causal_retentions", "causal_chunks", "guard_tokens",
                "completion", "max_new_tokens", "split"):
        assert meta[key] == whole["meta"][key], key
    assert [p["path"] for p in meta["parts"]] == ["p1.jsonl", "p2.jsonl"]
    assert [p["dialogues"] for p in meta["parts"]] == [1, 1]
    assert meta["command"][0].startswith("python benchmarks/quality.py --merge")
    assert "--save-results" in meta["command"][1] and "--start 1" in meta["command"][2]


def test_results_file_has_a_header_and_one_line_per_dialogue(parts):
    rows = lines(parts / "p2.jsonl")
    header = rows[0]["header"]
    assert {"arch", "model", "grid", "guard_tokens", "completion", "max_new_tokens", "torch", "transformers",
            "device", "command", "args"} <= set(header)
    assert header["grid"] == json.loads(json.dumps([k for k, _ in quality.config_grid(_args(header))]))
    assert [r["index"] for r in rows[1:]] == [1]
    assert len(rows[1]["runs"]) == len(header["grid"])


def _args(header):
    import argparse

    return argparse.Namespace(**header["args"])


def test_rerun_skips_the_finished_dialogues(parts, capsys):
    before = (parts / "p1.jsonl").read_text()
    argv = QUICK + ["--start", "0", "--dialogues", "1", "--save-results", str(parts / "p1.jsonl"),
                    "--out", str(parts / "again.json")]
    assert quality.main(argv) == 0
    assert "1 of the 1 dialogues already there, skipped" in capsys.readouterr().out
    assert (parts / "p1.jsonl").read_text() == before
    again = json.loads((parts / "again.json").read_text())
    assert again["records"] == json.loads((parts / "p1.json").read_text())["records"]


def test_cut_off_last_line_is_dropped_when_resuming(parts, tmp_path):
    path = tmp_path / "p2.jsonl"
    shutil.copy(parts / "p2.jsonl", path)
    good = path.read_text()
    with open(path, "a") as f:
        f.write('{"index": 7, "runs": {"[\\"full\\"')  # a run killed while writing
    assert quality.main(QUICK + ["--start", "1", "--dialogues", "1", "--save-results", str(path),
                                 "--out", str(tmp_path / "o.json")]) == 0
    assert path.read_text() == good


def test_another_configuration_is_refused(parts, tmp_path):
    p1 = str(parts / "p1.jsonl")
    before = (parts / "p1.jsonl").read_text()
    with pytest.raises(SystemExit, match="'grid' differs"):
        quality.main(["--selectors", "uniform", "--retentions", "0.3", "--chunks", "15", "--dialogues", "1",
                      "--save-results", p1, "--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="'guard_tokens' differs: 16 in .*p1.jsonl, 8 in this run"):
        quality.main(QUICK + ["--guard-tokens", "8", "--dialogues", "1", "--save-results", p1,
                              "--out", str(tmp_path / "o.json")])
    assert (parts / "p1.jsonl").read_text() == before
    # a merge checks the headers too
    rows = lines(parts / "p2.jsonl")
    rows[0]["header"]["max_new_tokens"] = 32
    (tmp_path / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="cannot merge .*p1.jsonl and .*other.jsonl: 'max_new_tokens' differs"):
        quality.main(["--merge", p1, str(tmp_path / "other.jsonl"), "--out", str(tmp_path / "o.json")])


def test_merge_keeps_a_repeated_dialogue_once_and_refuses_a_conflicting_one(parts, tmp_path, capsys):
    p1, p2 = str(parts / "p1.jsonl"), str(parts / "p2.jsonl")
    assert quality.main(["--merge", p1, p2, p1, "--out", str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["records"] == json.loads((parts / "m.json").read_text())["records"]
    # a gzip-compressed part (as committed) merges the same; a run cannot append to one
    import gzip

    with gzip.open(tmp_path / "p2.jsonl.gz", "wb") as f:
        f.write((parts / "p2.jsonl").read_bytes())
    assert quality.main(["--merge", p1, str(tmp_path / "p2.jsonl.gz"), "--out", str(tmp_path / "z.json")]) == 0
    assert json.loads((tmp_path / "z.json").read_text())["records"] == merged["records"]
    with pytest.raises(SystemExit):
        quality.main(QUICK + ["--save-results", str(tmp_path / "p2.jsonl.gz"), "--out", str(tmp_path / "o.json")])
    rows = lines(parts / "p1.jsonl")
    run = next(iter(rows[1]["runs"].values()))
    run["correct"][0] = not run["correct"][0]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="dialogue 0 is in .*p1.jsonl and in .*bad.jsonl with different results"):
        quality.main(["--merge", p1, str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o.json")])
    # parts with a gap: merged, with a warning
    assert quality.main(["--merge", p2, "--out", str(tmp_path / "one.json")]) == 0
    capsys.readouterr()
    gap = lines(parts / "p2.jsonl")
    gap[1]["index"] = 3
    (tmp_path / "gap.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gap))
    assert quality.main(["--merge", p1, str(tmp_path / "gap.jsonl"), "--out", str(tmp_path / "g.json")]) == 0
    assert "not one contiguous range: [[0, 0], [3, 3]] (missing [[1, 2]])" in capsys.readouterr().out
    assert json.loads((tmp_path / "g.json").read_text())["runs"]["qwen3_vl"]["meta"]["indices"] == [[0, 0], [3, 3]]


def test_a_part_of_other_configurations_merges_into_the_union_of_the_grids(parts, tmp_path, capsys):
    """p1 + p2 (Full, Hard, Raincheck chunk 31 both visibilities) and a Raincheck-only part at chunk 15 merge into
    the summary of one run with chunks 15 and 31."""
    grid = ["--selectors", "uniform", "--retentions", "0.3", "--bootstrap", "200"]
    assert quality.main(grid + ["--chunks", "15", "31", "--dialogues", "2", "--out", str(tmp_path / "whole.json")]) == 0
    part = grid + ["--chunks", "15", "--causal-retentions", "--policies", "raincheck", "--dialogues", "2"]
    with pytest.raises(SystemExit):  # no Full / Hard runs: only as a part of a grid, in a results file
        quality.main(part + ["--out", str(tmp_path / "o.json")])
    c = tmp_path / "c.jsonl"
    assert quality.main(part + ["--save-results", str(c), "--out", str(tmp_path / "o.json")]) == 0
    assert "no summary" in capsys.readouterr().out and not (tmp_path / "o.json").exists()
    assert lines(c)[0]["header"]["grid"] == [["raincheck", "uniform", 0.3, 15, "boundary"]]
    p1, p2 = str(parts / "p1.jsonl"), str(parts / "p2.jsonl")
    assert quality.main(["--merge", p1, str(c), p2, "--out", str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["records"] == json.loads((tmp_path / "whole.json").read_text())["records"]
    meta = merged["runs"]["qwen3_vl"]["meta"]
    assert meta["chunks"] == [31, 15] and meta["dialogues"] == 2
    assert [p["configurations"] for p in meta["parts"]] == [4, 1, 4]
    with pytest.raises(SystemExit, match="lacks the Full / Hard runs"):
        quality.main(["--merge", str(c), "--out", str(tmp_path / "o.json")])
    # a dialogue without a run of every configuration is left out, with a warning
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps(r) + "\n" for r in lines(c)[:2]))
    capsys.readouterr()
    assert quality.main(["--merge", p1, p2, str(short), "--out", str(tmp_path / "s.json")]) == 0
    assert "1 dialogues lack a run of some configuration of the merged grid and are left out: [[1, 1]]" in \
        capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["runs"]["qwen3_vl"]["meta"]["indices"] == [[0, 0]]


def test_one_merge_writes_each_architecture_from_its_own_parts(parts, tmp_path):
    p1, p2 = str(parts / "p1.jsonl"), str(parts / "p2.jsonl")
    other = []
    for name in ("p1", "p2"):  # the same results under another arch's header: a stand-in for Qwen3.5 parts
        rows = lines(parts / f"{name}.jsonl")
        rows[0]["header"]["arch"] = "qwen3_5"
        (tmp_path / f"{name}_35.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        other.append(str(tmp_path / f"{name}_35.jsonl"))
    out = tmp_path / "both.json"
    assert quality.main(["--merge", other[0], p1, other[1], p2, "--out", str(out)]) == 0
    both = json.loads(out.read_text())
    assert set(both["runs"]) == {"qwen3_vl", "qwen3_5"}
    vl = json.loads((parts / "m.json").read_text())["runs"]["qwen3_vl"]["records"]
    assert both["runs"]["qwen3_vl"]["records"] == vl
    assert both["runs"]["qwen3_5"]["records"] == [{**r, "arch": "qwen3_5"} for r in vl]
    assert len(both["records"]) == 2 * len(vl)


def test_turn1_rows_by_question_and_later_answers_compared_with_full():
    """The summary's turn-1 subsets (named-cell / line questions, each kind) and the share of later answers equal
    to Full's, also counted only where every earlier answer was equal (a different turn-1 answer in the history
    changes what follows, whatever restoration did)."""
    import argparse

    full, rain = ("full", None, None, None, None), ("raincheck", "mmtok", 0.3, 31, "boundary")
    hard = ("hard", "mmtok", 0.3, None, None)

    def dialogue(index, kinds, full_answers, rain_answers, hard_answers):
        def run(answers):
            return {"correct": [a == f for a, f in zip(answers, full_answers)], "answers": answers,
                    "tokens": [1] * len(answers), "stats": {"during_decode": 0, "after_answer": 0, "during_prefill": 0},
                    "seconds": 0.0}
        return {"index": index, "kinds": kinds, "gold_tokens": [40 if k == "row" else 4 for k in kinds],
                "runs": {json.dumps(full): run(full_answers), json.dumps(rain): run(rain_answers),
                         json.dumps(hard): run(hard_answers)}}

    results = [dialogue(0, ["cell", "row"], ["a", "b"], ["a", "b"], ["a", "x"]),
               dialogue(1, ["row", "cell"], ["c", "d"], ["y", "z"], ["y", "z"]),  # turn 1 differs, then turn 2
               dialogue(2, ["row", "cell"], ["e", "f"], ["e", "f"], ["w", "f"])]
    subsets = quality.turn1_subsets(results, guard_tokens=16)
    assert list(subsets["named_cells"]) == [0] and list(subsets["line"]) == [1, 2] and list(subsets["long"]) == [1, 2]
    assert list(subsets["kind=row"]) == [1, 2] and "kind=search" not in subsets
    grid = [(full, None), (hard, None), (rain, None)]
    args = argparse.Namespace(guard_tokens=16, seed=0, bootstrap=50, arch="qwen3_vl", completion="blocking")
    records, _, _ = quality.summarize(results, grid, args)
    get = {(r["policy"], r["turn"], r["subset"]): r for r in records}
    later = get[("raincheck", "2+", "all")]
    assert later["same_as_full"] == 2 / 3 and later["same_as_full_same_history"] == 1.0 and later["n_same_history"] == 2
    assert get[("raincheck", "1", "line")]["accuracy"] == 0.5 and get[("hard", "1", "line")]["accuracy"] == 0.0
    assert get[("raincheck", "1", "line")]["recovered"] == 0.5
    assert get[("hard", "1", "named_cells")]["accuracy"] == 1.0


def test_background_completion_preempted_at_random_points_answers_later_turns_like_full():
    """``--completion background``: the next question arrives a random time after the answer (drawn from the
    dialogue's index), preempting the worker wherever it is; turn 1 here is a cell question, whose short answer ends
    with every deferred token pending, and turns 2+ answer like Full prefill."""
    from hf_raincheck import RaincheckConfig, enable_raincheck
    from hf_raincheck.gridqa import load_default, make_dialogue

    model, processor = load_default("qwen3_vl")
    enable_raincheck(model)
    dialogue = make_dialogue(1, "test", kinds=["cell", "row", "column"])
    full, _ = quality.play(model, processor, dialogue, None, 64)
    config = RaincheckConfig(retention=0.3, pruning="mmtok", chunk_size=31, guard_tokens=16,
                             completion="background", completion_chunk_size=4)
    turns, stats = quality.play(model, processor, dialogue, config, 64, preempt_s=0.005)
    assert [t[0] for t in turns[1:]] == [t[0] for t in full[1:]]
    # every deferred token restored exactly once: during the decode, by the worker, or folded into a later prefill
    assert stats["during_decode"] + stats["after_answer"] + stats["during_prefill"] == 44
