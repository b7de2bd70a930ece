"""The CUDA-graph path, checked where it can be on a CPU: the fixed-shape steps (padding rows, length
buckets) are lossless, and their passes compile with torch.compile(fullgraph=True), which fails on any
host synchronisation or data-dependent branch, the things that break (or silently freeze) a CUDA graph."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import BLOCK, PROMPTS, load_pair
from dflash_runtime import SamplingParams, SpeculativeEngine
from dflash_runtime.engine_sizes import cache_capacity
from dflash_runtime.step_graphs import MIN_LENGTH_BUCKET, StepGraphs, batch_bucket, length_bucket, length_buckets
from test_verify_length import Cycle, cycle_block_size, mixed_requests


def test_buckets():
    assert [batch_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [batch_bucket(n, 6) for n in (3, 5, 6)] == [4, 6, 6]
    assert length_bucket(1, 4096) == MIN_LENGTH_BUCKET and length_bucket(MIN_LENGTH_BUCKET + 1, 4096) == 256
    assert length_buckets(2048 + 16) == (128, 256, 512, 1024, 2064)  # 2,048 is within 25 % of the capacity
    assert length_bucket(1000, 1040) == 1040 and length_bucket(500, 1040) == 512  # the capacity is the last
    assert length_buckets(100) == (100,)
    # the capacity holds the last block and is a multiple of 16 (mem-efficient attention's mask alignment)
    assert [cache_capacity(2048, k) for k in (1, 8, 16)] == [2064, 2064, 2064] and cache_capacity(2032, 16) == 2048


def test_step_graphs_without_cuda_run_the_pass_itself():
    graphs = StepGraphs(capture=False)
    assert graphs.run(("x",), lambda a, b: a + b, torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]
    assert not graphs.graphs


@pytest.mark.parametrize("schedule", [[BLOCK], [1, 16, 2, 8, 4, 1, 1, 16], ["suffix 8", 1, 16, "suffix 16"]])
def test_static_shapes_are_lossless_with_padding_rows(tiny, schedule):
    """More requests than slots and different lengths: slots free up, so steps run over padding rows (3
    sequences run as 4 rows, the batch bucket); greedy and sampled requests side by side, any verify length."""
    target, drafter = load_pair(tiny)
    params = mixed_requests() * 2
    prompts = PROMPTS * 2
    plain = [s.output_ids for s in SpeculativeEngine(target, block_size=1, max_batch_size=4).generate(prompts, params)]
    engine = SpeculativeEngine(target, drafter, block_size=cycle_block_size(schedule), max_batch_size=4,
                               static_shapes=True)
    engine._plan = Cycle(schedule)
    padded, tables = [], engine._tables
    engine._tables = lambda batch, length: padded.append(None in batch) or tables(batch, length)
    assert [s.output_ids for s in engine.generate(prompts, params)] == plain
    assert any(padded)  # some steps really ran over padding rows


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
    batch = engine.scheduler.running
    assert len(batch) == 3
    starts = torch.tensor([s.last_position for s in batch] + [0])
    tokens = torch.tensor([[s.output_ids[-1]] for s in batch] + [[0]])
    context = max(s.last_position for s in batch)
    draft_length, verify_length = engine._length(context + BLOCK), engine._length(context + k)
    table = engine._tables(batch + [None], draft_length)
    assert table.shape[0] == 4 and (table[3] == 0).all()  # the padding row reads the null block

    def draft(tokens, starts, table):
        return engine._draft_pass(tokens, starts, table, length=draft_length, k=k)

    def verify(block, starts, table):
        return engine._verify_pass(block, starts, table, length=verify_length)

    torch._dynamo.reset()
    with torch.inference_mode():
        draft_logits = draft(tokens, starts, table) if k > 1 else None
        block = torch.cat([tokens, draft_logits.argmax(-1)], dim=1) if k > 1 else tokens
        logits, features = verify(block, starts, table)
        if k > 1:
            compiled_draft_logits = torch.compile(draft, fullgraph=True)(tokens, starts, table)
            assert torch.equal(compiled_draft_logits.argmax(-1), draft_logits.argmax(-1))
            torch.testing.assert_close(compiled_draft_logits, draft_logits, rtol=1e-4, atol=1e-4)
        compiled_logits, compiled_features = torch.compile(verify, fullgraph=True)(block, starts, table)
    assert torch.equal(compiled_logits.argmax(-1), logits.argmax(-1))
    torch.testing.assert_close(compiled_logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled_features, features, rtol=1e-4, atol=1e-4)


def test_gpu_check_tool_runs_on_a_cpu(tmp_path, capsys):
    """make gpu-check's timing tool, end to end on the tiny shape: transformers and our engine load the same
    random weights, and every figure of its table is there and positive, at short and long context, with the
    SDPA backend of every kind of attention."""
    from dflash_tools import gpu_check

    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--shapes", "tiny", "--batch-sizes", "1", "2", "--steps", "2",
                           "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["batch"], r["context"]) for r in rows] == [
        ("tiny", 1, "short"), ("tiny", 2, "short"), ("tiny", 1, "long"), ("tiny", 2, "long")]
    for r in rows:
        assert min(r["hf_generate_ms_per_token"], r["ar_step_ms"], r["bandwidth_floor_ms"]) > 0
        for block in gpu_check.BLOCKS:
            figures = r[f"block{block}"]
            assert figures["draft_ms"] > 0 and figures["verify_ms"] > 0
            assert figures["noise_ms"] > 0 and figures["sample_ms"] > 0
            assert list(figures["tokens_per_second"]) == ["1", "3", "6"]
        # CPU: SDPA's flash kernel takes GQA and the mask as they are; nothing is captured without CUDA
        assert r["sdpa_backends"] == {kind: ["FLASH_ATTENTION"] for kind in ("decode", "draft", "prefill", "verify")}
        assert {g["graphs"] for g in r["cuda_graphs"].values()} == {0}
    assert rows[2]["keys"] > 2000 and rows[2]["bandwidth_floor_ms"] > rows[0]["bandwidth_floor_ms"]
    printed = capsys.readouterr().out
    assert "AR/fl" in printed and "n/v16" in printed and "SDPA backend" in printed
    paged = json.loads(out.read_text())["paged_attention"]
    assert [(r["batch"], r["keys"]) for r in paged] == [(1, 2048), (1, 16384), (2, 2048), (2, 16384)]
    assert all(r["paged_ms"] > 0 and r["contiguous_ms"] > 0 for r in paged) and "paged attention" in printed
    host = json.loads(out.read_text())["host_phases"]  # dflash-profile-step's rows (test_step_profile.py)
    assert [(r["batch"], r["block"]) for r in host] == [(1, 1), (1, 8), (2, 1), (2, 8)]
    assert all(r["host_us"] > 0 and r["ops_per_step"] > 0 for r in host) and "| host us |" in printed


def test_bounds_checks_hold_inside_a_compiled_pass(tiny, monkeypatch):
    """DFLASH_CHECK_BOUNDS=1 (the GPU debugging switch) must not break a captured pass: its eager check copies
    to the host, which capture forbids, so inside a capture or a compiled trace it asserts on the device.
    torch.compile(fullgraph=True) fails on a host copy as capture does; an out-of-bounds write is caught either way."""
    from dflash_runtime import kv_cache

    monkeypatch.setattr(kv_cache, "CHECK_BOUNDS", True)
    target, _ = load_pair(tiny)
    cache = target.new_cache(5, block_size=16)
    table = cache.sequential_table(2, 32)

    def verify(tokens, positions):
        return target(tokens, positions, cache, table, length=32)[0]

    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    inside, outside = torch.tensor([[3, 4, 5], [29, 30, 31]]), torch.tensor([[3, 4, 5], [30, 31, 32]])
    torch._dynamo.reset()
    compiled = torch.compile(verify, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(tokens, inside).argmax(-1), verify(tokens, inside).argmax(-1))
        with pytest.raises(IndexError, match="position 32 beyond the table's 32 positions"):
            verify(tokens, outside)
        with pytest.raises(RuntimeError, match="beyond the table's 32 positions"):
            compiled(tokens, outside)


def test_the_graphs_planned_at_start_up_cover_every_step(tiny):
    """On CUDA the engine captures graph_keys() when it starts and nothing afterwards: every (pass, R, k, length)
    that steps of mixed requests run (auto picks k, slots free up, a long prompt reaches a larger bucket) must be
    among them; the plan is bounded, keeps small batches and short contexts first, and runs largest first."""
    from dflash_runtime.step_graphs import StepGraphs

    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, max_batch_size=4, static_shapes=True, max_context=400)
    used, run = set(), engine.graphs.run
    engine.graphs.run = lambda key, fn, *inputs: used.add(key) or run(key, fn, *inputs)
    long_prompt = [t % 120 for t in range(300)]
    engine.generate(PROMPTS * 2 + [long_prompt], mixed_requests() * 2 + [SamplingParams(max_new_tokens=40)])
    planned = engine.graph_keys()
    assert used <= set(planned) and {128, 416} <= {k[3] for k in used}  # length buckets 128, 256, 416
    # R 1, 2, 4 x 3 length buckets x (k 2, 4, 8, 16: draft and verify; k 1: verify only)
    assert len(planned) == len(set(planned)) == 3 * 3 * (4 * 2 + 1)
    assert planned == sorted(planned, key=lambda k: (k[1], k[2], k[3]), reverse=True)
    engine.graphs = StepGraphs(capture=False, max_graphs=10)
    bounded = engine.graph_keys()
    assert len(bounded) == 10 and {k[1] for k in bounded} == {1}  # batch 1 first


def test_graphs_of_a_pass_share_their_output_buffers():
    """Outputs of every graph of a pass are views of one buffer per output (the largest's size), so graphs
    for many shapes do not each hold their own logits; a larger or differently typed output gets a new one."""
    from dflash_runtime.step_graphs import StepGraphs

    graphs = StepGraphs(capture=False)
    big = graphs._output_views("verify", (torch.ones(4, 8, 10), None))
    small = graphs._output_views("verify", (torch.ones(2, 3, 10), None))
    assert big[1] is None and small[0].shape == (2, 3, 10)
    assert small[0].data_ptr() == big[0].data_ptr() and len(graphs.buffers) == 1
    draft = graphs._output_views("draft", torch.ones(4, 8, dtype=torch.long))
    assert draft.dtype == torch.long and len(graphs.buffers) == 2
    larger = graphs._output_views("verify", (torch.ones(8, 8, 10), None))
    assert larger[0].data_ptr() != big[0].data_ptr()
