"""python builder/build.py: a target and its DFlash drafter -> a deployable build (see `--help`).

The layout of a build is dflash_contract.layout's; the options and the command line are builder/options.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.options import BuildOptions, build_parser, check_options, option_notes, options_from_args
from builder.render import TORCH_MODELS, render_repository
from dflash_contract import DFlashError
from dflash_contract.layout import (DRAFTER_DIR, MANIFEST_FILE, REPOSITORY_DIR, TARGET_DIR, TRTLLM_OPTIONS_FILE,
                                    VERIFY_PROFILE_FILE, build_key, file_hashes, read_manifest)
from dflash_contract.presets import AUTO_BLOCK_SIZE
from dflash_runtime.checkpoint import resolve_checkpoint, resolve_target
from dflash_runtime.config import DrafterConfig, TargetConfig

PACKAGES = ("torch", "transformers", "nvidia-modelopt", "tritonclient", "nvidia-pytriton", "tensorrt-llm")
SANITY_PROMPTS = ["Explain what a hash table is and when to use one.", "Write a haiku about autumn."]


@dataclass
class Inputs:
    target_dir: Path
    drafter_dir: Path | None
    drafter: DrafterConfig | None
    preset: str | None
    block_size: int | str  # or "auto"
    max_context: int

    @property
    def profiles(self) -> bool:
        """Whether the engine picks verify lengths from a profile of step times (block size auto)."""
        return self.block_size == AUTO_BLOCK_SIZE


def resolve_inputs(opts: BuildOptions) -> Inputs:
    """Find the checkpoints and check that the drafter fits the target, before any heavy work."""
    check_options(opts)
    target_dir, preset = resolve_target(opts.target)
    drafter_ref = (preset.drafter if preset else None) if opts.drafter == "preset" else opts.drafter
    if drafter_ref in (None, "none"):
        drafter_dir = None
    else:
        drafter_dir = resolve_checkpoint(drafter_ref)
    target_config = TargetConfig.from_dir(target_dir)
    if opts.max_context is not None:
        target_config.check_max_context(opts.max_context)
    block_size = opts.block_size
    drafter_config = None
    if drafter_dir is not None:
        drafter_config = DrafterConfig.from_dir(drafter_dir)
        drafter_config.check_against(target_config, str(drafter_dir))
        if block_size != AUTO_BLOCK_SIZE and block_size > drafter_config.block_size:
            raise DFlashError(f"--block-size {block_size} is larger than the drafter supports "
                              f"({drafter_config.block_size})")
    elif block_size == AUTO_BLOCK_SIZE:
        block_size = 1  # nothing to choose from: plain decoding (the plan says so)
    elif block_size != 1:
        raise DFlashError(f"--block-size {block_size} needs a drafter")
    max_context = opts.max_context or (preset.max_context if preset else 2048)
    return Inputs(target_dir, drafter_dir, drafter_config, preset.name if preset else None, block_size, max_context)


def checked_flags(opts: BuildOptions) -> str:
    """The flags check_options judged, as a command line: the target and runtime, and the others set."""
    flags = [("--target", opts.target), ("--runtime", opts.runtime)]
    flags += [(flag, value) for flag, value, default in [
        ("--gpu", opts.gpu, None), ("--quant", opts.quant, "none"), ("--kv-cache", opts.kv_cache, "none"),
        ("--tensor-parallel-size", opts.tensor_parallel_size, 1),
        ("--pipeline-parallel-size", opts.pipeline_parallel_size, 1)] if value != default]
    return " ".join(f"{flag} {shlex.quote(str(value))}" for flag, value in flags)


def plan(inputs: Inputs, opts: BuildOptions, output: Path) -> list[str]:
    steps = [f"target   {inputs.target_dir}" + (f" (preset {inputs.preset})" if inputs.preset else ""),
             f"drafter  {inputs.drafter_dir or 'none (plain autoregressive)'}, block size {inputs.block_size}"
             + (f" (up to {inputs.drafter.block_size})" if inputs.profiles else "")]
    if opts.quant == "none":
        steps.append(f"copy the target into {output / TARGET_DIR}")
    else:
        steps.append(f"quantize the target with ModelOpt: {opts.quant}, KV cache {opts.kv_cache}, "
                     f"{opts.calib_samples} ShareGPT calibration samples -> {output / TARGET_DIR}")
    steps.append(f"copy the drafter into {output / DRAFTER_DIR}" if inputs.drafter_dir else "no drafter to copy")
    if opts.runtime == "torch":
        steps.append(f"render the Triton model repository ({', '.join(TORCH_MODELS)}) into {output / REPOSITORY_DIR}: "
                     f"max batch {opts.max_batch_size}, context {inputs.max_context}, {opts.dtype} on {opts.device}")
    else:
        steps.append(f"write TensorRT-LLM LLM-API options ({TRTLLM_OPTIONS_FILE}: DFlash, "
                     f"tp {opts.tensor_parallel_size}, "
                     f"pp {opts.pipeline_parallel_size}, max batch {opts.max_batch_size}) and render the LLM-API "
                     f"model repository into {output / REPOSITORY_DIR}; validate them where tensorrt_llm imports")
    if opts.sanity_tokens:
        steps.append(f"sanity run: {len(SANITY_PROMPTS)} prompts x {opts.sanity_tokens} tokens, "
                     "autoregressive vs DFlash, token identity, tau"
                     + (f"; profile step times for block size auto -> {output / VERIFY_PROFILE_FILE}"
                        if inputs.profiles else ""))
    steps.append(f"write {output / MANIFEST_FILE}")
    return steps


def copy_checkpoint(source: Path, destination: Path) -> None:
    """Hard links where the filesystem allows (checkpoints are never modified in place), else copies."""
    destination.mkdir(parents=True)
    for path in source.rglob("*"):
        if path.is_dir() or path.name.startswith("."):
            continue
        out = destination / path.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path.resolve(), out)
        except OSError:
            shutil.copy2(path, out)


def repository_values(inputs: Inputs, opts: BuildOptions) -> dict[str, object]:
    # Paths are relative to the repository root, so the build folder can move (a volume, a container).
    return {
        "max_batch_size": opts.max_batch_size,
        "tokenizer_dir": f"../{TARGET_DIR}",
        "target_dir": f"../{TARGET_DIR}",
        "drafter_dir": f"../{DRAFTER_DIR}" if inputs.drafter_dir else "",
        "block_size": inputs.block_size,
        # made by the sanity run; without one the server profiles when it starts
        "verify_profile": f"../{VERIFY_PROFILE_FILE}" if inputs.profiles and opts.sanity_tokens else "",
        "max_context": inputs.max_context,
        "max_queue_size": opts.max_queue_size,
        "dtype": opts.dtype,
        "device": opts.device,
        "preprocessing_instances": 1,
        "postprocessing_instances": 1,
    }


def sanity_run(build: Path, inputs: Inputs, opts: BuildOptions) -> dict:
    """Autoregressive vs DFlash on the built artifacts: token identity, tau and speed. With block size
    auto, the engine's profile of step times (all batch sizes up to the build's) goes to
    VERIFY_PROFILE_FILE for the server."""
    from dflash_runtime.pipeline import load_pipeline
    from dflash_tools.benchmark import measure

    drafter = str(build / DRAFTER_DIR) if inputs.drafter_dir else None
    pipe = load_pipeline(str(build / TARGET_DIR), drafter, opts.dtype, opts.device)
    prompts = [pipe.encode(p) for p in SANITY_PROMPTS]
    autoregressive = pipe.engine(block_size=1, max_batch_size=1, max_context=inputs.max_context)
    dflash = pipe.engine(block_size=inputs.block_size, max_batch_size=opts.max_batch_size,
                         max_context=inputs.max_context)
    result = measure(pipe, None, autoregressive, {str(inputs.block_size): dflash}, prompts, opts.sanity_tokens,
                     "sanity")
    if dflash.graphs.capture:
        report = dflash.graphs.report
        result["cuda_graphs"] = {"graphs": report.graphs, "MiB": round(report.pool_bytes / 2 ** 20, 1),
                                 "seconds": round(report.seconds, 2)}
    if dflash.policy is not None:
        profile = dflash.policy.costs.to_json()
        (build / VERIFY_PROFILE_FILE).write_text(json.dumps(profile, indent=2) + "\n")
        rates = [round(p, 4) for p in dflash.policy.acceptance[True].rates()]  # the sanity run is greedy
        result["verify_profile"] = {**profile, "acceptance_rates": rates}
    return result


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def resolve_device_options(opts: BuildOptions) -> BuildOptions:
    """Options with device and dtype "auto" made concrete for this machine (a GPU: CUDA and bfloat16), so the
    manifest, the build key and the model repository name what ran; CUDA asked for but absent is an error."""
    from dflash_runtime.pipeline import resolve_device, resolve_dtype

    device = resolve_device(opts.device)
    return replace(opts, device=device, dtype=resolve_dtype(opts.dtype, device))


def build(opts: BuildOptions, output: Path, force: bool = False) -> dict:
    """Build into `output`; returns the manifest. Reuses an existing identical build unless `force`."""
    started = time.time()
    opts = resolve_device_options(opts)
    inputs = resolve_inputs(opts)
    output = output.resolve()
    _check_writable(output.parent)
    hashes = {"target": file_hashes(inputs.target_dir),
              "drafter": file_hashes(inputs.drafter_dir) if inputs.drafter_dir else {}}
    key = build_key({**asdict(opts), "block_size": inputs.block_size, "max_context": inputs.max_context}, hashes)
    if (output / MANIFEST_FILE).is_file() and not force:
        try:
            existing = read_manifest(output).data
        except DFlashError:  # unreadable or not a manifest: nothing to reuse, rebuilt like any stale build
            existing = {}
        if existing.get("build_key") == key:
            return {**existing, "reused": True}
    stage = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        manifest = _build_into(stage, output, inputs, opts, hashes, key, started)
        if output.exists():
            old = output.with_name(f".{output.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            output.rename(old)
            stage.rename(output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            stage.rename(output)
    except OSError as e:
        shutil.rmtree(stage, ignore_errors=True)
        raise DFlashError(f"writing the build failed ({e.strerror or e}: {e.filename or stage}); nothing was "
                          "published. Check free disk space and permissions.") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return manifest


def _build_into(stage: Path, output: Path, inputs: Inputs, opts: BuildOptions, hashes: dict, key: str,
                started: float) -> dict:
    quantization = None
    if opts.quant == "none":
        copy_checkpoint(inputs.target_dir, stage / TARGET_DIR)
    else:
        from builder.quantize import quantize_target

        quantization = quantize_target(inputs.target_dir, stage / TARGET_DIR, opts.quant, opts.kv_cache,
                                       opts.calib_samples, device=opts.device)
    if inputs.drafter_dir:
        copy_checkpoint(inputs.drafter_dir, stage / DRAFTER_DIR)
    sanity = sanity_run(stage, inputs, opts) if opts.sanity_tokens else None
    trtllm = None
    if opts.runtime == "torch":
        render_repository(stage / REPOSITORY_DIR, repository_values(inputs, opts))
    else:
        trtllm = write_trtllm_artifacts(stage, output, inputs, opts, (sanity or {}).get("verify_profile"))
    manifest = {
        "build_key": key,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs": {"target": opts.target, "target_dir": str(inputs.target_dir), "preset": inputs.preset,
                   "drafter_dir": str(inputs.drafter_dir) if inputs.drafter_dir else None, "file_sha256": hashes},
        "options": {**asdict(opts), "block_size": inputs.block_size, "max_context": inputs.max_context},
        "artifacts": {"target": TARGET_DIR, "drafter": DRAFTER_DIR if inputs.drafter_dir else None,
                      "model_repository": REPOSITORY_DIR,
                      "models": sorted(p.name for p in (stage / REPOSITORY_DIR).iterdir())},
        "quantization": quantization,
        "trtllm": trtllm,
        "sanity": sanity,
        "versions": {"python": platform.python_version(), **package_versions()},
        "seconds": round(time.time() - started, 1),
    }
    (stage / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def write_trtllm_artifacts(stage: Path, output: Path, inputs: Inputs, opts: BuildOptions,
                           verify_profile: dict | None) -> dict:
    """LLM-API options for TensorRT-LLM's PyTorch backend (DFlash) and the LLM-API model repository.

    The options name the build's final paths (where the server will find them); validation reads the
    staged copies. Block size auto becomes a draft_len_schedule where the sanity run profiled a GPU
    (a CPU profile says nothing of TensorRT-LLM on a GPU); otherwise the drafter's whole block.
    """
    from builder.trtllm import (TrtllmOptions, draft_len_schedule, llm_api_options, render_trtllm_repository,
                                serve_command, validate_llm_args, write_extra_llm_api_options)

    drafter = inputs.drafter
    if drafter is None:
        raise DFlashError("--runtime trtllm serves DFlash: it needs a drafter")
    schedule = None
    if inputs.profiles and verify_profile and opts.device.startswith("cuda"):
        schedule = draft_len_schedule(verify_profile["seconds"], verify_profile["acceptance_rates"])
    options = llm_api_options(
        drafter=output / DRAFTER_DIR, block_size=drafter.block_size if inputs.profiles else inputs.block_size,
        options=TrtllmOptions(tensor_parallel_size=opts.tensor_parallel_size,
                              pipeline_parallel_size=opts.pipeline_parallel_size,
                              max_batch_size=opts.max_batch_size, max_seq_len=inputs.max_context),
        mask_token_id=drafter.mask_token_id, target_layer_ids=list(drafter.target_layer_ids), schedule=schedule)
    write_extra_llm_api_options(options, stage / TRTLLM_OPTIONS_FILE)
    render_trtllm_repository(stage / REPOSITORY_DIR, options, model=output / TARGET_DIR)
    validation = validate_llm_args(options, model=stage / TARGET_DIR, speculative_model=stage / DRAFTER_DIR)
    return {"options": options, "options_file": TRTLLM_OPTIONS_FILE, "gpu": opts.gpu,
            "validated": validation.validated, "validation": validation.message,
            "serve_command": serve_command(output / TARGET_DIR, output / TRTLLM_OPTIONS_FILE)}


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"cannot create the output's parent folder {folder}: {e.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise DFlashError(f"the output's parent folder {folder} is not writable")


def summary(manifest: dict, output: Path) -> str:
    options, sanity = manifest["options"], manifest.get("sanity") or {}
    rows = [("build", str(output) + ("  (reused: inputs unchanged)" if manifest.get("reused") else "")),
            ("target", f"{manifest['inputs']['target']} ({manifest['inputs']['target_dir']})"),
            ("drafter", manifest["inputs"]["drafter_dir"] or "none"),
            ("runtime", f"{options['runtime']}, {options['dtype']} on {options['device']}, "
                        f"block {options['block_size']}, max batch {options['max_batch_size']}"),
            ("quantization", options["quant"] + (f", KV {options['kv_cache']}" if options["quant"] != "none" else ""))]
    quantization = manifest.get("quantization")
    if quantization:
        rows.append(("quality", f"perplexity {quantization['perplexity']} (unquantized "
                                f"{quantization['unquantized']['perplexity']}), greedy agreement "
                                f"{quantization['greedy_agreement']} ({quantization['measured_with']})"))
    if manifest.get("trtllm"):
        rows.append(("tensorrt-llm", f"{manifest['trtllm']['options_file']}: {manifest['trtllm']['validation']}"))
    if sanity:
        (block, dflash), = sanity["dflash"].items()
        rates = sanity["tokens_per_second"]
        rows += [("sanity", f"tau {dflash['mean_acceptance_length']}, DFlash {rates[f'dflash {block}']} tok/s vs "
                            f"autoregressive {rates['autoregressive']} tok/s "
                            f"({dflash['speedup_vs_autoregressive']}x; verify lengths {dflash['verify_lengths']}), "
                            f"token-identical {sanity['token_identical_prompts']}")]
        if sanity.get("cuda_graphs"):
            graphs = sanity["cuda_graphs"]
            rows.append(("cuda graphs", f"{graphs['graphs']} captured at start-up in {graphs['seconds']} s, "
                                        f"{graphs['MiB']} MiB (max batch {options['max_batch_size']})"))
    rows += [("repository", str(output / REPOSITORY_DIR)), ("time", f"{manifest['seconds']} s"),
             ("serve", f"dflash-serve {output / REPOSITORY_DIR}" if options["runtime"] == "torch" else
                       " ".join(manifest["trtllm"]["serve_command"]) + "   (or Triton's LLM-API backend: "
                       f"tritonserver --model-repository {output / REPOSITORY_DIR})")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def drafter_training_args(target: str, train_args: str) -> argparse.Namespace:
    """dflash-train-drafter's arguments for --train-drafter: the build's target, and by default
    the resumable run directory runs/<target>-drafter."""
    from dflash_training import train_drafter

    parser = train_drafter.build_parser()
    parser.set_defaults(target=None)
    default_output = str(Path("runs") / f"{Path(target).name}-drafter")  # an --output in ARGS comes later and wins
    try:
        args = parser.parse_args(["--output", default_output, *shlex.split(train_args)])
    except SystemExit:  # argparse has printed what is wrong
        raise DFlashError("--train-drafter: bad arguments for dflash-train-drafter (see its --help)") from None
    if args.target is not None:
        raise DFlashError("--train-drafter trains for the build's --target; leave --target out of its arguments")
    args.target = target
    return args


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = options_from_args(args)
    output = args.output or Path("builds") / Path(args.target).name
    try:
        training = None
        if args.train_drafter is not None:
            if args.drafter != "preset":
                raise DFlashError("--train-drafter and --drafter both name the drafter")
            if args.block_size != AUTO_BLOCK_SIZE:
                raise DFlashError("with --train-drafter the trainer sets the block size: "
                                  "--train-drafter='--block-size N ...'")
            training = drafter_training_args(args.target, args.train_drafter)
        check_options(opts)
        for note in option_notes(opts):
            print(f"build.py: note: {note}", file=sys.stderr)
        if args.check:  # the device is the build machine's, not this one's: left as given
            print(f"check: ok: {checked_flags(opts)}")
            return 0
        if output.exists() and not output.is_dir():
            raise DFlashError(f"--output {output} is a file; a build is written to a folder: name a new one or an "
                              "existing build")
        opts = resolve_device_options(opts)
        if training is not None:
            # everything but the drafter is checked before hours of training
            resolve_inputs(replace(opts, drafter="none"))
            _check_writable(output.resolve().parent)
            opts = replace(opts, drafter=str(Path(training.output) / "drafter"))
        if args.dry_run:
            steps = ([f"train a drafter: dflash-train-drafter, resumable in {training.output}",
                      "build with the trained drafter"] if training else plan(resolve_inputs(opts), opts, output))
            print("plan:\n" + "\n".join(f"  {n}. {s}" for n, s in enumerate(steps, 1)))
            return 0
        if training is not None:
            from dflash_training.train_drafter import train

            train(training)
        manifest = build(opts, output, force=args.force)
    except DFlashError as e:
        print(f"build.py: error: {e}", file=sys.stderr)
        return 2
    print(summary(manifest, output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
