"""builder/build.py: artifacts, manifest, rendered configs, reuse, quantized builds, bad input."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from builder.build import BuildOptions, build, main
from builder.render import parse_model_config
from builder.summary import summary
from builder.trtllm import validate_llm_args
from deploy.serve import ServeError, stage_trtllm_repository
from dflash_contract import DFlashError, layout
from dflash_contract.layout import TEMPLATES, build_key, file_hashes, read_manifest
from dflash_contract.protocol import (BLS_INPUTS, ENGINE_INPUTS, FINISH_REASON, FRONT_INPUTS, LOGPROB_OUTPUTS,
                                      STATISTICS, TOKEN_OUTPUTS, config_type)

REPO = Path(__file__).resolve().parent.parent


def test_default_build_is_complete_and_reused(default_build, capsys):
    manifest = json.loads((default_build / "manifest.json").read_text())
    assert manifest["artifacts"]["models"] == ["dflash", "dflash_bls", "ensemble", "postprocessing", "preprocessing"]
    assert manifest["options"]["block_size"] == "auto" and manifest["inputs"]["preset"] == "smollm2-135m"
    assert manifest["inputs"]["file_sha256"]["drafter"]["model.safetensors"]
    for name in manifest["artifacts"]["models"]:
        config = parse_model_config(default_build / "model_repository" / name / "config.pbtxt")
        assert config.name == name and config.max_batch_size == 8
    for name in ("dflash", "dflash_bls"):
        config = parse_model_config(default_build / "model_repository" / name / "config.pbtxt")
        assert config.model_transaction_policy.decoupled
    dflash = parse_model_config(default_build / "model_repository" / "dflash" / "config.pbtxt")
    assert dflash.parameters["drafter_dir"].string_value == "../drafter"  # relative: the build can move
    assert dflash.parameters["block_size"].string_value == "auto"
    assert dflash.parameters["speculative_sampling"].string_value == "exact"
    assert dflash.parameters["cpu_weights"].string_value == "auto"  # the serving host measures
    assert dflash.parameters["verify_profile"].string_value == ""  # no sanity run: the server profiles itself
    again = build(BuildOptions(target="smollm2-135m", drafter="preset", max_batch_size=8, sanity_tokens=0),
                  default_build)
    assert again["reused"] and again["build_key"] == manifest["build_key"]


def test_fp8_build_reports_quality_and_stays_lossless(tmp_path, monkeypatch, capsys):
    argv = ["--quant", "fp8", "--calib-samples", "8", "--sanity-tokens", "16", "--output", str(tmp_path / "fp8")]

    def interrupted(*_):
        raise KeyboardInterrupt  # Ctrl-C once quantizing is done

    # Ctrl-C: one line, nothing published, the quantized target kept for the next run
    monkeypatch.setattr("builder.build.sanity_run", interrupted)
    assert main(argv) == 130
    err = capsys.readouterr().err
    kept, = tmp_path.glob(".fp8.quantized-*")
    assert f"build.py: interrupted; nothing was published; the quantized target is kept in {kept}" in err
    assert "Traceback" not in err and not (tmp_path / "fp8").exists() and (kept / "quantization.json").is_file()
    monkeypatch.undo()

    def quantized_again(*_, **__):
        raise AssertionError("the kept quantized target was not reused")

    monkeypatch.setattr("builder.quantize.quantize_target", quantized_again)
    assert main(argv) == 0
    assert "quantized earlier, reused kept by an earlier run" in capsys.readouterr().out
    assert not list(tmp_path.glob(".fp8.quantized-*"))  # published: the build holds it now
    manifest = json.loads((tmp_path / "fp8" / "manifest.json").read_text())
    assert (tmp_path / "fp8" / "target" / "hf_quant_config.json").is_file()
    quality = manifest["quantization"]
    assert quality["quant"] == "fp8" and quality["calibration"]["samples"] == 8
    assert 0 < quality["perplexity"] < 2 * quality["unquantized"]["perplexity"]
    sanity = manifest["sanity"]
    assert sanity["token_identical_prompts"] == "2/2" and sanity["dflash"]["auto"]["mean_acceptance_length"] >= 1
    # block size auto: the sanity run's profile of step times, for every batch size the server may run
    profile = json.loads((tmp_path / "fp8" / "verify_profile.json").read_text())
    assert profile["seconds"].keys() == {"1", "2", "4", "8"}
    assert sanity["verify_profile"]["seconds"] == profile["seconds"]
    assert all(ks.keys() == {"1", "2", "4", "8"} for ks in profile["seconds"].values())
    assert profile["verify_seconds"].keys() == profile["seconds"].keys()  # the verify alone: a suffix draft's step
    # and the acceptance it learned, which the server starts from (drafter: one count per draft of the block)
    from dflash_contract.presets import PRESETS

    learned = profile["acceptance"]
    assert len(learned["drafter"]["greedy"]["reached"]) == PRESETS["smollm2-135m"].block_size - 1
    assert all(key.startswith("greedy/") for key in learned["suffix"])
    # what auto did, from what was measured: the steps of each draft source, what a block costs here
    words = re.search(r"auto +(.*)", summary(manifest, tmp_path / "fp8")).group(1)
    steps = sum(s["steps"] for s in sanity["dflash"]["auto"]["by_source"].values())
    assert re.fullmatch(rf"(.* on \d+ of {steps} steps.*)+: here a verify of 8 tokens costs [\d.]+x one token with the "
                        r"drafter's pass, [\d.]+x without it( \(the start-up timings were too noisy to trust: .*\))?; "
                        r"a step pays where it brings more tokens than it costs", words), words
    assert words == sanity["auto"]  # one source: the manifest's line
    dflash = parse_model_config(tmp_path / "fp8" / "model_repository" / "dflash" / "config.pbtxt")
    assert dflash.parameters["verify_profile"].string_value == "../verify_profile.json"
    assert not list(tmp_path.glob(".*partial*"))
    # another serving option: the build is redone, its quantized target taken from the previous build
    assert main([*argv, "--max-batch-size", "4", "--sanity-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert f"reused from the previous build at {tmp_path / 'fp8'}" in out

    def requantized(*_, **__):
        raise RuntimeError("quantized again")

    monkeypatch.setattr("builder.quantize.quantize_target", requantized)
    with pytest.raises(RuntimeError, match="quantized again"):  # --force redoes the quantization too
        main([*argv, "--max-batch-size", "4", "--sanity-tokens", "0", "--force"])
    assert (tmp_path / "fp8" / "manifest.json").is_file()  # and the build in place stays until a new one is done
    # the summary reads as words, not a dict
    quality = re.search(r"quality +(.*)", out).group(1)
    assert re.fullmatch(r"perplexity [\d.]+ vs [\d.]+ unquantized \([+-][\d.]+%\); greedy answers (identical on all \d+ "
                        r"tokens of \d+ prompts|agree on [\d.]+% of \d+ tokens; \d+ of \d+ prompts leave the reference's "
                        r"path, after \d+ tokens on average); on the fake-quantized model .*", quality), quality


def test_trtllm_build_writes_llm_api_artifacts(tiny, tmp_path):
    manifest = build(BuildOptions(target=str(tiny[0]), drafter=str(tiny[1]), runtime="trtllm",
                                  gpu="h100", tensor_parallel_size=2, sanity_tokens=0), tmp_path / "trt")
    options = manifest["trtllm"]["options"]
    assert options["speculative_config"]["decoding_type"] == "DFlash" and options["tensor_parallel_size"] == 2
    # block size auto without a GPU profile: the drafter's whole block, no draft_len_schedule
    speculative = options["speculative_config"]
    assert speculative["max_draft_len"] == 15 and "draft_len_schedule" not in speculative
    assert options["speculative_config"]["speculative_model"] == "./drafter"  # relative: the build can move
    assert (tmp_path / "trt" / "extra_llm_api_options.yaml").is_file()
    assert not manifest["trtllm"]["validated"] and "not importable" in manifest["trtllm"]["validation"]
    # the summary says what runs where, and hints only at commands that work on this build
    text = summary(manifest, tmp_path / "trt")
    assert "runtime       trtllm: TensorRT-LLM's PyTorch backend on h100 (SM90, Hopper)" in text
    assert "tritonserver --model-repository" not in text and f"dflash-serve {tmp_path / 'trt' / 'model_repository'}" in text
    assert f"cd {tmp_path / 'trt'} && trtllm-serve ./target --config extra_llm_api_options.yaml" in text
    # moved to where a server mounts it, the build still names its own checkpoints
    moved = tmp_path / "volume" / "build"
    moved.parent.mkdir()
    (tmp_path / "trt").rename(moved)
    code = tmp_path / "image"  # stand-ins for NVIDIA's model.py and helpers.py
    code.mkdir()
    for name in ("model.py", "helpers.py"):
        (code / name).write_text("# NVIDIA's\n")
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    staged = stage_trtllm_repository(moved / "model_repository", runtime, code)
    served = yaml.safe_load((staged / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert served["model"] == str(moved / "target")
    assert served["speculative_config"]["speculative_model"] == str(moved / "drafter")
    assert {k: v for k, v in served.items() if k not in ("model", "speculative_config", "backend", "triton_config")} \
        == {k: v for k, v in options.items() if k != "speculative_config"}
    validate_llm_args(served, model=served["model"])  # where tensorrt_llm imports, upstream's own check
    assert "speculative_model: ./drafter" in (moved / "model_repository" / "tensorrt_llm" / "1" / "model.yaml").read_text()
    shutil.rmtree(moved / "drafter")  # moved without its drafter: refused at launch, naming what is missing
    with pytest.raises(ServeError, match=r"names speculative_model ./drafter, and .*/volume/build/drafter holds no "):
        stage_trtllm_repository(moved / "model_repository", tmp_path / "runtime2", code)


def test_a_dry_run_names_every_missing_checkpoint_and_how_to_fetch_them(tmp_path, monkeypatch, capsys):
    # Before: the target alone was named, with exit 2 and no plan; the user fetched it, retried, fetched again.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("DFLASH_MODEL_DIR", raising=False)
    assert main(["--target", "qwen3-8b", "--dry-run", "--output", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert "1. target   Qwen/Qwen3-8B (preset qwen3-8b)  [MISSING]" in captured.out
    assert "2. drafter  z-lab/Qwen3-8B-DFlash-b16, block size auto  [MISSING]" in captured.out
    assert "write " in captured.out and captured.out.count("not found locally") == 2
    assert captured.err == ("build.py: error: 2 checkpoints missing; fetch on a connected machine, then build: "
                            "hf download Qwen/Qwen3-8B && hf download z-lab/Qwen3-8B-DFlash-b16\n")
    # a real build names both too, before any work
    assert main(["--target", "qwen3-8b", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "2 checkpoints missing: target: checkpoint 'Qwen/Qwen3-8B' not found" in err and "drafter: " in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--target", "no-such-model"], "neither a preset"),
    (["--runtime", "trtllm", "--gpu", "h100", "--quant", "nvfp4"], "needs Blackwell"),
    (["--runtime", "trtllm"], "needs --gpu"),
    (["--tensor-parallel-size", "2"], "needs --runtime trtllm"),
    (["--kv-cache", "fp8"], "needs --quant"),
    (["--block-size", "32"], "larger than the drafter supports"),
    (["--device", "cuda"], "sees no CUDA GPU here"),
    (["--target", "qwen3-coder-30b-a3b"], "runs on --runtime trtllm only, not torch"),
    (["--tensor-parallel-size", "0", "--runtime", "trtllm", "--gpu", "h100"],
     "--tensor-parallel-size must be >= 1, got 0"),
    # each bad number is named alone, with its rule and value
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
    (["--max-queue-size", "-1"], "--max-queue-size must be >= 0, got -1"),
    (["--calib-samples", "0", "--quant", "fp8"], "--calib-samples must be >= 1, got 0"),
    (["--sanity-tokens", "-1"], "--sanity-tokens must be >= 0, got -1"),
    (["--shared-suffix-tokens", "-1"], "--shared-suffix-tokens must be >= 0, got -1"),
    (["--shared-suffix-tokens", "4096", "--no-suffix-drafts"], "suffix drafts on (no --no-suffix-drafts)"),
    (["--shared-suffix-tokens", "1"], "room for 2 tokens at least"),
    (["--max-context", "1"], "--max-context 1 leaves no room for a prompt and a block: use 40 or more"),
    (["--max-context", "1000000", "--dry-run"], "--max-context 1000000 is beyond this target's 8192 positions"),
    # the hint names a flag that exists, and that flag works (test_check_...)
    (["--runtime", "trtllm", "--gpu", "rtx9999"], "for another GPU give its compute capability, major*10+minor: "
                                                 "--gpu sm90"),
    (["--gpu", "rtx9999"], "unknown GPU 'rtx9999'"),  # misspelt, whatever the runtime
])
def test_bad_options_fail_before_any_work(argv, message, tmp_path, capsys):
    assert main([*argv, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err  # one line: no usage text, no traceback
    assert not (tmp_path / "out").exists()


def test_a_bad_flag_value_is_one_line_too(tmp_path, capsys):
    # argparse's own refusals (a type or a choice) in the builder's form, not the whole usage text
    for argv, message in ((["--block-size", "0"], "block size must be 'auto' or an integer >= 1, got '0'"),
                          (["--quant", "int4"], "invalid choice: 'int4'")):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--output", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("build.py: error: argument ") and err.count("\n") == 1, err
        assert message in err


def test_a_file_as_output_and_a_gpu_the_runtime_ignores(tmp_path, capsys):
    file = tmp_path / "README.md"
    file.write_text("not a build")
    assert main(["--output", str(file), "--dry-run"]) == 2
    assert f"--output {file} is a file" in capsys.readouterr().err and file.read_text() == "not a build"
    # --gpu with the torch runtime: said to do nothing there, not silently ignored
    assert main(["--gpu", "h100", "--quant", "nvfp4", "--dry-run", "--output", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "note: --gpu h100 matters only to --runtime trtllm" in err and "dequantizing --quant nvfp4" in err


@pytest.fixture
def no_checkpoints_or_devices(monkeypatch):
    """--check must pass or fail on the flags alone: reading a checkpoint or a device fails the test."""
    def touched(*_):
        raise AssertionError("--check read a checkpoint or a device")

    for name in ("resolve_inputs", "resolve_device_options", "resolve_target", "resolve_checkpoint"):
        monkeypatch.setattr(f"builder.build.{name}", touched)


def test_check_passes_flags_a_gpu_cluster_would_run(no_checkpoints_or_devices, tmp_path, capsys):
    """A build Job's command, checked on this CPU machine without its checkpoints."""
    argv = ["--target", "qwen3-coder-30b-a3b", "--runtime", "trtllm", "--gpu", "h100", "--quant", "fp8",
            "--tensor-parallel-size", "2", "--output", str(tmp_path / "out")]
    assert main([*argv, "--check"]) == 0
    assert capsys.readouterr().out == ("check: ok: --target qwen3-coder-30b-a3b --runtime trtllm --gpu h100 "
                                       "--quant fp8 --tensor-parallel-size 2\n")
    assert main(["--device", "cuda", "--check"]) == 0  # the cluster's device, not this machine's
    assert capsys.readouterr().out == "check: ok: --target smollm2-135m --runtime torch --device cuda\n"
    assert main(["--runtime", "trtllm", "--gpu", "sm90", "--quant", "fp8", "--check"]) == 0  # a GPU by capability
    assert capsys.readouterr().out == "check: ok: --target smollm2-135m --runtime trtllm --gpu sm90 --quant fp8\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--runtime", "trtllm"], "--runtime trtllm needs --gpu"),
    (["--runtime", "trtllm", "--gpu", "h100", "--quant", "nvfp4"], "quantization nvfp4 does not run on h100"),
    (["--target", "qwen3-coder-30b-a3b"], "preset qwen3-coder-30b-a3b runs on --runtime trtllm only, not torch"),
    (["--tensor-parallel-size", "2"], "tensor/pipeline parallelism needs --runtime trtllm"),
    (["--tensor-parallel-size", "0", "--runtime", "trtllm", "--gpu", "h100"],
     "--tensor-parallel-size must be >= 1, got 0"),
    (["--pipeline-parallel-size", "0", "--runtime", "trtllm", "--gpu", "h100"],
     "--pipeline-parallel-size must be >= 1, got 0"),
    (["--train-drafter=--no-such-option"], "bad arguments for dflash-train-drafter"),
    (["--runtime", "trtllm", "--gpu", "h100", "--speculative-sampling", "rejection"],
     "--speculative-sampling rejection is for --runtime torch"),
])
def test_check_refuses_what_the_flags_rule_out(argv, message, no_checkpoints_or_devices, capsys):
    assert main([*argv, "--check"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "check: ok" not in captured.out


def test_check_and_dry_run_do_not_combine(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--check", "--dry-run"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_every_preset_names_known_runtimes():
    from builder.options import RUNTIMES
    from dflash_contract.presets import PRESETS

    assert all(p.runtimes and set(p.runtimes) <= set(RUNTIMES) for p in PRESETS.values())


def test_drafter_that_does_not_fit_the_target_is_refused(tiny, tmp_path):
    with pytest.raises(DFlashError, match="drafter does not fit the target"):
        build(BuildOptions(target="smollm2-135m", drafter=str(tiny[1])), tmp_path / "out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_output_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(DFlashError, match="not writable"):
        build(BuildOptions(target="smollm2-135m", drafter="preset"), locked / "out")


def test_output_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DFlashError, match="cannot create"):
        build(BuildOptions(target="smollm2-135m", drafter="preset"), tmp_path / "file" / "out")


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    assert main(["--quant", "fp8", "--dry-run", "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "quantize the target with ModelOpt: fp8" in out and "sanity run" in out
    assert "float32 on cpu" in out  # device and dtype auto, on a machine without a GPU
    assert not (tmp_path / "out").exists()


def test_device_and_dtype_auto_pick_cuda_and_bfloat16_where_there_is_a_gpu(monkeypatch):
    """What a GPU machine would use for calibration, the sanity run and serving (no GPU needed to check)."""
    import torch

    from builder.build import resolve_device_options
    from builder.quantize import QuantizeOptions

    opts = BuildOptions(target="smollm2-135m", drafter="preset")
    assert (opts.device, opts.dtype) == ("auto", "auto")
    here = resolve_device_options(opts)
    assert (here.device, here.dtype) == ("cpu", "float32")
    assert resolve_device_options(replace(opts, dtype="bfloat16")).dtype == "bfloat16"  # an explicit choice stays
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = resolve_device_options(opts)
    assert (gpu.device, gpu.dtype) == ("cuda", "bfloat16")
    assert QuantizeOptions("fp8", device=gpu.device).model_dtype == torch.bfloat16  # calibration in bf16
    assert QuantizeOptions("fp8", device=here.device).model_dtype == torch.float32


def test_build_can_train_its_drafter_first(tmp_path, monkeypatch, capsys):
    """--train-drafter: a (very short) training run, then a build whose drafter is the one just trained."""
    run = tmp_path / "train"
    train_args = (f"--output {run} --draft-layers 1 --block-size 8 --batch-size 1 --seq-len 64 --anchors 2 --steps 1 "
                  "--eval-every 1 --train-vocab 512 --tau-prompts 1")
    assert main([f"--train-drafter={train_args}", "--sanity-tokens", "8", "--output", str(tmp_path / "out")]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["inputs"]["file_sha256"]["drafter"] == file_hashes(run / "drafter")
    assert manifest["options"]["block_size"] == "auto" and manifest["sanity"]["token_identical_prompts"] == "2/2"

    monkeypatch.chdir(tmp_path)  # the trainer's default run directory is runs/<target>-drafter under it
    assert main(["--train-drafter=--steps 1", "--dry-run", "--output", str(tmp_path / "bad")]) == 0
    assert "resumable in runs/smollm2-135m-drafter" in capsys.readouterr().out
    for argv in (["--train-drafter=--target=x"], ["--train-drafter=--no-such-option"],
                 ["--train-drafter=--steps 1", "--block-size", "8"],  # the trainer's option, not the build's
                 ["--train-drafter=--steps 1", "--drafter", "none"],
                 ["--train-drafter=--steps 1", "--kv-cache", "fp8"]):
        assert main([*argv, "--output", str(tmp_path / "bad")]) == 2, argv
    assert not (tmp_path / "bad").exists() and not (tmp_path / "runs").exists()  # refused before any training


def test_a_template_change_redoes_the_build(tiny, tmp_path):
    # The build key once hashed options and checkpoints only: after an edit of a model-repository
    # template, build.py reused the old build and the old model.py was served. Run the builder of a
    # copy of the code, whose templates the test may edit.
    checkout = tmp_path / "checkout"
    for name in ("builder", "dflash_contract", "dflash_runtime", "dflash_serving", "dflash_tools", "model_repository"):
        shutil.copytree(REPO / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", checkout)
    output = tmp_path / "build"
    command = [sys.executable, str(checkout / "builder" / "build.py"), "--target", str(tiny[0]), "--drafter",
               str(tiny[1]), "--sanity-tokens", "0", "--output", str(output)]

    def run_build() -> tuple[str, str]:
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        return out, read_manifest(output).data["build_key"]

    _, first = run_build()
    out, again = run_build()
    assert "reused" in out and again == first
    template = checkout / "model_repository" / "postprocessing" / "1" / "model.py"
    template.write_text(template.read_text() + "# edited\n")
    out, edited = run_build()
    assert "reused" not in out and edited != first
    assert (output / "model_repository" / "postprocessing" / "1" / "model.py").read_text().endswith("# edited\n")


def test_the_build_key_covers_options_inputs_templates_and_version(monkeypatch):
    key = build_key({"quant": "none"}, {"target": {"config.json": "0"}})
    assert key == build_key({"quant": "none"}, {"target": {"config.json": "0"}})
    assert key != build_key({"quant": "fp8"}, {"target": {"config.json": "0"}})
    assert key != build_key({"quant": "none"}, {"target": {"config.json": "1"}})
    monkeypatch.setattr(layout, "project_version", lambda: "99.0")
    assert key != build_key({"quant": "none"}, {"target": {"config.json": "0"}})


@pytest.mark.parametrize("model", ["ensemble", "dflash_bls"])
def test_front_models_declare_the_contract_tensors(model):
    # one list of names and types (dflash_contract.protocol) for the templates, the models and the clients
    text = (TEMPLATES / model / "config.pbtxt").read_text().replace("${max_batch_size}", "8")
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    types = model_config_pb2.DataType.Name
    own = BLS_INPUTS if model == "dflash_bls" else {}  # read where the text is made (protocol.BLS_INPUTS)
    assert {t.name: types(t.data_type) for t in config.input} == {
        name: config_type(kind) for name, kind in {**FRONT_INPUTS, **own}.items()}
    # required ones (REQUIRED_INPUTS) are checked by preprocessing, which names what is missing: a Triton
    # "required" input only counts towards a minimum number of inputs (see the ensemble's config)
    assert all(t.optional for t in config.input)
    assert {t.name: types(t.data_type) for t in config.output} == {
        "text_output": "TYPE_STRING", FINISH_REASON: "TYPE_STRING",
        **{s.tensor: config_type(s.data_type) for s in STATISTICS},
        **{name: config_type(kind) for name, kind in LOGPROB_OUTPUTS.items()}}


def test_preprocessing_checks_every_input_of_both_front_models():
    # preprocessing is the first step of the ensemble and the first call of dflash_bls: it takes all their
    # inputs, so one check refuses a malformed request with the same message on both
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    def parsed(model):
        text = (TEMPLATES / model / "config.pbtxt").read_text()
        return text_format.Parse(re.sub(r"\$\{\w+\}", "1", text), model_config_pb2.ModelConfig())

    types = model_config_pb2.DataType.Name
    assert {t.name: (types(t.data_type), t.optional) for t in parsed("preprocessing").input} == {
        name: (config_type(kind), True) for name, kind in FRONT_INPUTS.items()}
    first_step = parsed("ensemble").ensemble_scheduling.step[0]
    assert first_step.model_name == "preprocessing" and dict(first_step.input_map) == {n: n for n in FRONT_INPUTS}
    assert "_inputs(request, FRONT_INPUTS)" in (TEMPLATES / "dflash_bls" / "1" / "model.py").read_text()


def test_the_engine_model_declares_the_contract_tensors():
    text = (TEMPLATES / "dflash" / "config.pbtxt").read_text()
    outputs = text[text.index("output ["):]
    for name in (*TOKEN_OUTPUTS, FINISH_REASON, *(s.tensor for s in STATISTICS)):
        assert f'name: "{name}"' in outputs, name
    inputs = text[text.index("input ["):text.index("output [")]
    for name in (*ENGINE_INPUTS, "input_ids", "stream", "stop"):
        assert f'name: "{name}"' in inputs, name


def test_a_build_stopped_by_a_signal_ends_in_one_line_and_leaves_nothing(tmp_path):
    # SIGTERM (a deleted Job, a timeout) ends a build as Ctrl-C does: cleaned up, one line, exit 130
    build_py = subprocess.Popen([sys.executable, str(REPO / "builder" / "build.py"), "--sanity-tokens", "64",
                                 "--output", str(tmp_path / "out")], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.*.partial/drafter")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)  # the checkpoints are copied: the sanity run is loading them
    build_py.send_signal(signal.SIGTERM)
    _, err = build_py.communicate(timeout=120)
    assert build_py.returncode == 130, err
    assert err.strip().splitlines()[-1] == "build.py: interrupted; nothing was published" and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # no partial build, no output


# --- what cannot work is refused by --check, --dry-run and a build alike -------------------------------------

CANNOT_WORK = [
    (["--device", "tpu"], "--device tpu is not a device of the torch runtime: use auto, cpu, cuda or cuda:N"),
    # SmolLM2's 9 attention heads (3 KV heads) do not split over 2 GPUs
    (["--runtime", "trtllm", "--gpu", "h100", "--tensor-parallel-size", "2"],
     "--tensor-parallel-size 2 does not split smollm2-135m's 9 attention heads (3 KV heads) evenly over 2 GPUs, "
     "which TensorRT-LLM requires: use 1, 3, 9"),
    (["--runtime", "trtllm", "--gpu", "h100", "--pipeline-parallel-size", "31"],
     "--pipeline-parallel-size 31 is more stages than smollm2-135m's 30 layers"),
    (["--max-context", "10"], "--max-context 10 leaves no room for a prompt and a block: use 40 or more (32 tokens "
                              "for a short chat prompt, the drafter's block of 8 verified in one step)"),
    (["--max-context", "32", "--drafter", "none"], "use 33 or more (32 tokens for a short chat prompt, a new token)"),
    (["--runtime", "trtllm", "--gpu", "h100", "--drafter", "none"],
     "--runtime trtllm serves DFlash (TensorRT-LLM's DFlashDecodingConfig) and needs a drafter (--drafter none)"),
]


@pytest.mark.parametrize("mode", ["--check", "--dry-run", "build"])
@pytest.mark.parametrize("argv, message", CANNOT_WORK, ids=[" ".join(a) for a, _ in CANNOT_WORK])
def test_what_cannot_work_is_refused_in_one_line_before_any_work(argv, message, mode, tmp_path, capsys):
    # Before: --check and --dry-run exited 0 on each of these; a build failed late or served what cannot work
    out = tmp_path / "out"
    assert main([*argv, *([mode] if mode != "build" else []), "--output", str(out)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
    assert "check: ok" not in captured.out and "plan:" not in captured.out and not out.exists()


def test_check_splits_a_local_targets_heads_as_tensorrt_llm_does_and_says_what_it_could_not_check(
        no_checkpoints_or_devices, tmp_path, capsys):
    """12 attention heads, 3 KV heads (GQA): TensorRT-LLM splits the KV heads (kv % tp == 0) or copies each to
    tp / kv GPUs (tp % kv == 0); tp 4 is neither, tp 6 copies each KV head to 2 GPUs."""
    target = tmp_path / "my-llama"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 4,
        "num_attention_heads": 12, "num_key_value_heads": 3, "vocab_size": 1000, "rope_theta": 5e5}))  # no weights
    trtllm = ["--target", str(target), "--drafter", "acme/my-llama-dflash", "--runtime", "trtllm", "--gpu", "h100"]
    assert main([*trtllm, "--tensor-parallel-size", "4", "--check"]) == 2
    assert "--tensor-parallel-size 4 does not split " in capsys.readouterr().err
    assert main([*trtllm, "--tensor-parallel-size", "6", "--check"]) == 0
    assert main([*trtllm, "--pipeline-parallel-size", "5", "--check"]) == 2
    assert "more stages than" in capsys.readouterr().err
    # a hub id whose checkpoint is not here: said to be unchecked, not passed as checked
    assert main(["--target", "acme/my-llama", *trtllm[2:], "--tensor-parallel-size", "2", "--check"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ("build.py: note: --tensor-parallel-size 2 not checked against acme/my-llama's attention "
                            "heads and layers: its config.json is not here (the build checks once the checkpoint "
                            "is)\n")
    assert captured.out.startswith("check: ok: --target acme/my-llama --runtime trtllm --drafter acme/my-llama-dflash")


def test_the_presets_known_shapes_are_their_checkpoints():
    """--check judges presets on shapes written in presets.py: for the one whose checkpoint is here, they agree."""
    from dflash_contract.presets import PRESETS
    from dflash_runtime.checkpoint import resolve_target
    from dflash_runtime.config import TargetConfig

    target_dir, preset = resolve_target("smollm2-135m")
    shape = TargetConfig.from_dir(target_dir).shape
    assert (preset.layers, preset.heads, preset.kv_heads) == (shape.num_layers, shape.num_heads, shape.num_kv_heads)
    assert all(p.heads % p.kv_heads == 0 and p.layers > 0 for p in PRESETS.values())


def test_without_a_drafter_the_sanity_run_is_plain_decoding(tmp_path, capsys):
    # Before: --drafter none planned and ran "autoregressive vs DFlash", comparing plain decoding with itself
    argv = ["--drafter", "none", "--sanity-tokens", "4", "--output", str(tmp_path / "plain")]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "sanity run: 2 prompts x 4 tokens, plain decoding (no drafter to compare)" in out
    assert "DFlash" not in out and "tau" not in out
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "build.py: sanity check: loading the built target (" in err  # what the build does while it is quiet
    sanity = json.loads((tmp_path / "plain" / "manifest.json").read_text())["sanity"]
    assert set(sanity) == {"num_prompts", "tokens_per_second"}
    assert set(sanity["tokens_per_second"]) == {"autoregressive"}
    assert re.search(r"sanity +plain decoding \(no drafter\): [\d.]+ tok/s", out), out


def test_a_hub_id_target_is_built_from_the_local_checkpoints(tmp_path, monkeypatch):
    """What the chart's build Job runs for model.target / model.drafter given as hub ids, once downloaded."""
    from dflash_runtime.checkpoint import resolve_target

    models = tmp_path / "models"  # $DFLASH_MODEL_DIR/<name>, one of the local places a hub id is looked up
    models.mkdir()
    (models / "smollm2-support").symlink_to(resolve_target("smollm2-135m")[0])
    (models / "smollm2-support-dflash").symlink_to(REPO / "models" / "smollm2-135m-dflash")
    monkeypatch.setenv("DFLASH_MODEL_DIR", str(models))
    manifest = build(BuildOptions(target="acme/smollm2-support", drafter="acme/smollm2-support-dflash",
                                  sanity_tokens=0), tmp_path / "support")
    assert manifest["inputs"]["target"] == "acme/smollm2-support" and manifest["inputs"]["preset"] is None
    assert manifest["inputs"]["target_dir"] == str(models / "smollm2-support")
    assert manifest["inputs"]["drafter_dir"] == str(models / "smollm2-support-dflash")


def test_a_build_removes_what_killed_builds_left_but_not_what_a_live_build_writes(tmp_path, capsys):
    from builder.staging import partial_folder

    out = tmp_path / "out"
    # A build killed hard (SIGKILL: no clean-up runs) leaves its locked partial folder; its lock dies with it
    killed = subprocess.run([sys.executable, "-c", "import os, signal, sys; from pathlib import Path\n"
                             "from builder.staging import partial_folder\n"
                             f"with partial_folder(Path({str(out)!r})) as stage:\n"
                             "    (stage / 'target').mkdir(); os.kill(os.getpid(), signal.SIGKILL)"], cwd=REPO)
    assert killed.returncode == -signal.SIGKILL
    (left,) = tmp_path.glob(".out.*.partial")
    older = tmp_path / ".out.x1y2z3.partial"  # one from before builds locked their folders
    older.mkdir()
    with partial_folder(out) as live:  # another build, writing now
        (live / "target").mkdir()
        build(BuildOptions(target="smollm2-135m", drafter="none", sanity_tokens=0), out)
        assert not left.exists() and not older.exists() and (live / "target").is_dir()
        err = capsys.readouterr().err
        assert f"build.py: note: removed {left}, left by a build that was killed" in err
    assert not live.exists()
    assert (out / "manifest.json").is_file() and not list(out.glob(".*"))  # published without its lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
