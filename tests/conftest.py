"""Small checkpoints made by the tests: random tiny targets in HF format, tiny drafters in the z-lab format.

A random drafter never agrees with the target, which would leave the acceptance path untested, so one
drafter per target is also trained briefly on the target's own greedy outputs (random tiny models fall
into repetitive patterns a drafter learns in seconds).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# The suite holds the embedded default to transformers' float32 answers and to tau figures that must not depend on
# which format a host measures fastest: float32 unless a test (test_cpu_weights.py) asks for another. The
# servers the tests start inherit it.
os.environ.setdefault("DFLASH_CPU_WEIGHTS", "float32")
sys.path.insert(0, str(REPO))

from dflash_training.block_loss import block_loss  # noqa: E402
from dflash_training.features import target_features  # noqa: E402
from dflash_training.train_drafter import new_drafter  # noqa: E402
from dflash_runtime import SamplingParams, SpeculativeEngine, load_drafter, load_target, save_drafter  # noqa: E402

# Tests that start a tritonserver: through these fixtures, or marked `tritonserver` where they start one themselves
SERVER_FIXTURES = {"default_server", "short_context", "held", "llmapi_server", "overload_server", "soak_server"}
# Python 3.13 has none to start: nvidia-pytriton 0.7.0, whose CPU tritonserver the suite serves with, needs numpy<2,
# which has no wheel for 3.13 (pyproject.toml's markers); the NGC image's tritonserver is found on PATH
NO_TRITONSERVER = (None if importlib.util.find_spec("pytriton") or shutil.which("tritonserver") else
                   f"no tritonserver on Python {sys.version_info.major}.{sys.version_info.minor}: nvidia-pytriton "
                   "(the CPU tritonserver) needs numpy<2, which has no wheel for it")


def pytest_configure(config):
    config.addinivalue_line("markers", "tritonserver: starts a tritonserver (skips where none can run: Python 3.13)")
    config.addinivalue_line("markers", "soak: the load soak against a real server (short here; `make soak`: 1,000)")
    config.addinivalue_line("markers", "llama_cpp: needs llama-cpp-python (the optional `llama` extra); skips without")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.tritonserver)  # so that `-m "not tritonserver"` selects the others
        if NO_TRITONSERVER and item.get_closest_marker("tritonserver"):
            item.add_marker(pytest.mark.skip(reason=NO_TRITONSERVER))


VOCAB = 128
EOS = 127
MASK = 126
BLOCK = 16
PROMPTS = [[3, 17, 99, 42, 7], [5, 6], list(range(20, 60)), [9] * 7]


def make_target(path: Path, arch: str) -> Path:
    import transformers

    torch.manual_seed(1 if arch == "qwen3" else 2)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=EOS, bos_token_id=1)
    if arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16, rope_theta=50000.0, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(config)
    else:  # Llama-3.1 style: tied head, llama3 RoPE scaling. With a tied head and the default init
        # scale, greedy decoding repeats one token for every prompt; a larger scale gives varied outputs.
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        # transformers 5 takes rope_parameters; 4.57 (the GPU serving image's, `make image-rehearsal`) ignores
        # that key and takes rope_theta + rope_scaling
        major = int(transformers.__version__.split(".")[0])
        rope = ({"rope_parameters": {**scaling, "rope_theta": 500000.0}} if major >= 5
                else {"rope_theta": 500000.0, "rope_scaling": scaling})
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True, initializer_range=0.12, **rope)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return path


def train_tiny_drafter(target_dir: Path, out: Path, steps: int = 300) -> Path:
    torch.manual_seed(0)
    target = load_target(target_dir)
    drafter = new_drafter(target, num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=(1, 3))
    engine = SpeculativeEngine(target, max_batch_size=8)
    g = torch.Generator().manual_seed(0)
    # The test prompts are part of the training prompts: whether a random tiny target's outputs are
    # learnable otherwise depends on the draw, and the tests need real multi-token acceptance.
    prompts = PROMPTS + [torch.randint(0, MASK, (int(n),), generator=g).tolist()
                         for n in torch.randint(3, 12, (32 - len(PROMPTS),), generator=g)]
    texts = [s.prompt_ids + s.output_ids for s in
             engine.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for step in range(steps):
        batch = texts[(step * 8) % 32:(step * 8) % 32 + 8]
        tokens, features, final = target_features(target, batch, drafter.config.target_layer_ids)
        loss, _, _ = block_loss(drafter, target, tokens, features, final, [len(b) for b in batch], BLOCK, 8, 7.0, g)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    save_drafter(drafter, out, torch.float32)
    return out


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny(request, tmp_path_factory):
    """(target_dir, trained_drafter_dir) for each architecture (~15 s each to make)."""
    root = tmp_path_factory.mktemp(request.param)
    target_dir = make_target(root / "target", request.param)
    return target_dir, train_tiny_drafter(target_dir, root / "drafter")


def load_pair(pair):
    target = load_target(pair[0])
    return target, load_drafter(pair[1], target.config)


def hf_greedy(target_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(prompt):].tolist()


def edited_copy(src: Path, dst: Path, edit_config=None, edit_state=None) -> Path:
    """A copy of a checkpoint directory with its config.json and/or model.safetensors edited."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    if edit_state:
        state = load_file(str(dst / "model.safetensors"))
        edit_state(state)
        save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="session")
def default_build(tmp_path_factory):
    """The embedded default built once per session (quant none, torch runtime, no sanity run)."""
    from builder.build import BuildOptions, build

    output = tmp_path_factory.mktemp("builds") / "smollm2-135m"
    build(BuildOptions(target="smollm2-135m", drafter="preset", max_batch_size=8, sanity_tokens=0), output)
    return output


@pytest.fixture(scope="session")
def default_server(default_build, tmp_path_factory):
    """A real tritonserver on the default build, with the OpenAI gateway, on free ports; its log goes to a temp file."""
    from deploy.serve import start_server

    log = tmp_path_factory.mktemp("server") / "tritonserver.log"
    with start_server(default_build / "model_repository", 0, 0, 0, log_path=log, openai_port=0) as server:
        yield server
