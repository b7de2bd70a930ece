"""The CUDA-graph path, checked where it can be on a CPU: the fixed-shape steps (padding rows, length
buckets) are lossless, and their passes compile with torch.compile(fullgraph=True), which fails on any
host synchronisation or data-dependent branch, the things that break (or silently freeze) a CUDA graph."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import BLOCK, PROMPTS, load_pair
from dflash_runtime import SamplingParams, SpeculativeEngine
from dflash_runtime.kv_cache import KVCache
from dflash_runtime.step_graphs import MIN_LENGTH_BUCKET, StepGraphs, batch_bucket, length_bucket
from test_verify_length import Cycle, mixed_requests


def test_buckets():
    assert [batch_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [batch_bucket(n, 6) for n in (3, 5, 6)] == [4, 6, 6]
    assert length_bucket(1, 4096) == MIN_LENGTH_BUCKET and length_bucket(MIN_LENGTH_BUCKET + 1, 4096) == 128
    assert length_bucket(1000, 1040) == 1024 and length_bucket(1030, 1040) == 1040  # capped at the capacity


def test_step_graphs_without_cuda_run_the_pass_itself():
    graphs = StepGraphs(capture=False)
    assert graphs.run(("x",), lambda a, b: a + b, torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]
    assert not graphs.graphs


@pytest.mark.parametrize("schedule", [[BLOCK], [1, 16, 2, 8, 4, 1, 1, 16]])
def test_static_shapes_are_lossless_with_padding_rows(tiny, schedule):
    """More requests than slots and different lengths: slots free up, so steps run over padding rows (3
    sequences run as 4 rows, the batch bucket); greedy and sampled requests side by side, any verify length."""
    target, drafter = load_pair(tiny)
    params = mixed_requests() * 2
    prompts = PROMPTS * 2
    plain = [s.output_ids for s in SpeculativeEngine(target, block_size=1, max_batch_size=4).generate(prompts, params)]
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4, static_shapes=True)
    engine._verify_length = Cycle(schedule)
    padded = []
    rows = engine._rows
    engine._rows = lambda batch: padded.append(len(rows(batch)[0]) > len(batch)) or rows(batch)
    assert [s.output_ids for s in engine.generate(prompts, params)] == plain
    assert any(padded)  # some steps really ran over free slots


def test_static_shapes_under_auto_are_lossless(tiny):
    target, drafter = load_pair(tiny)
    params = mixed_requests()
    plain = [s.output_ids for s in SpeculativeEngine(target, block_size=1, max_batch_size=4).generate(PROMPTS, params)]
    engine = SpeculativeEngine(target, drafter, max_batch_size=4, static_shapes=True)
    assert [s.output_ids for s in engine.generate(PROMPTS, params)] == plain


@pytest.mark.parametrize("k", [1, BLOCK])
def test_step_passes_compile_without_graph_breaks(tiny, k):
    """The draft and verify passes of a running batch (three sequences in four rows: one padding row) under
    torch.compile(fullgraph=True): no graph break, and the same tokens as eager."""
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4, static_shapes=True)
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.step()
    batch = engine.scheduler.batch()
    row_slots, row_of = engine._rows(batch)
    assert [s.slot for s in batch] == row_of == [0, 1, 2] and row_slots == [0, 1, 2, 3]
    starts = torch.tensor([batch[row_of.index(r)].last_position if r in row_of else 0 for r in row_slots])
    tokens = torch.tensor([[batch[row_of.index(r)].output_ids[-1] if r in row_of else 0] for r in row_slots])
    slots = torch.tensor(row_slots)
    rows = KVCache.rows(row_slots, slots)
    context = max(s.last_position for s in batch)
    draft_length, verify_length = engine._length(context), engine._length(context + k)

    def draft(tokens, starts, slots):
        return engine._draft_pass(tokens, starts, slots, rows=rows, length=draft_length, k=k)

    def verify(block, starts, slots):
        return engine._verify_pass(block, starts, slots, rows=rows, length=verify_length)

    torch._dynamo.reset()
    with torch.inference_mode():
        block = draft(tokens, starts, slots) if k > 1 else tokens
        logits, features = verify(block, starts, slots)
        if k > 1:
            assert torch.equal(torch.compile(draft, fullgraph=True)(tokens, starts, slots), block)
        compiled_logits, compiled_features = torch.compile(verify, fullgraph=True)(block, starts, slots)
    assert torch.equal(compiled_logits.argmax(-1), logits.argmax(-1))
    torch.testing.assert_close(compiled_logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled_features, features, rtol=1e-4, atol=1e-4)


def test_gpu_check_tool_runs_on_a_cpu(tmp_path, capsys):
    """make gpu-check's timing tool, end to end on the tiny shape: transformers and our engine load the same
    random weights, and every figure of its table is there and positive."""
    from dflash_tools import gpu_check

    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--shapes", "tiny", "--batch-sizes", "1", "2", "--steps", "2",
                           "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["batch"]) for r in rows] == [("tiny", 1), ("tiny", 2)]
    for r in rows:
        assert min(r["hf_generate_ms_per_token"], r["ar_step_ms"], r["bandwidth_floor_ms"]) > 0
        for block in gpu_check.BLOCKS:
            figures = r[f"block{block}"]
            assert figures["draft_ms"] > 0 and figures["verify_ms"] > 0
            assert list(figures["tokens_per_second"]) == ["1", "3", "6"]
    assert "AR/fl" in capsys.readouterr().out
