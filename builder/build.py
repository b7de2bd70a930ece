"""python builder/build.py: a target and its DFlash drafter -> a deployable build (see `--help`).

The layout of a build is dflash_contract.layout's; the options and the command line are builder/options.py's; where
a build is written before it is published, builder/staging.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.options import (BuildOptions, build_parser, check_context_room, check_options, option_notes,
                             options_from_args, reasoning_parser)
from builder.render import TORCH_MODELS, render_repository
from builder.sanity import SANITY_PROMPTS, sanity_run
from builder.staging import partial_folder, publish, remove_abandoned
from builder.summary import summary
from dflash_contract import DFlashError
from dflash_contract.layout import (DRAFTER_DIR, MANIFEST_FILE, REPOSITORY_DIR, TARGET_DIR, TRTLLM_OPTIONS_FILE,
                                    VERIFY_PROFILE_FILE, build_key, file_hashes, in_build, read_manifest)
from dflash_contract.presets import AUTO_BLOCK_SIZE, DEFAULT_KV_CONTEXT, DEFAULT_SPECULATIVE_SAMPLING, PRESETS
from dflash_runtime.checkpoint import is_hub_id, resolve_checkpoint, resolve_target
from dflash_runtime.config import DrafterConfig, TargetConfig, TransformerShape, read_json

PACKAGES = ("torch", "transformers", "nvidia-modelopt", "tritonclient", "nvidia-pytriton", "tensorrt-llm")


@dataclass
class Inputs:
    target_dir: Path | None  # None: not found (a dry run lists it in `missing`)
    drafter_dir: Path | None
    drafter: DrafterConfig | None
    preset: str | None
    block_size: int | str  # or "auto"
    max_context: int | None  # None: a dry run without the target's config
    target_ref: str = ""  # as given: a preset's repo id or a path
    drafter_ref: str | None = None
    missing: tuple[str, ...] = ()  # what a dry run could not find, each with how to fetch it

    @property
    def profiles(self) -> bool:
        """Whether the engine picks verify lengths from a profile of step times (block size auto)."""
        return self.block_size == AUTO_BLOCK_SIZE

    @property
    def block_width(self) -> int:
        """Tokens the widest step verifies: the drafter's block under auto, 1 without a drafter."""
        if self.profiles:
            return self.drafter.block_size if self.drafter else 1
        return self.block_size


def resolve_inputs(opts: BuildOptions, missing_ok: bool = False) -> Inputs:
    """Find the checkpoints and check that the drafter fits the target, before any heavy work. Every missing
    checkpoint is named at once (a user fetches them all, then builds); with `missing_ok` (a dry run) they are
    returned in Inputs.missing and the checks that need them are left out."""
    check_options(opts)
    preset = PRESETS.get(opts.target)
    target_ref = preset.target if preset else opts.target
    drafter_ref = (preset.drafter if preset else None) if opts.drafter == "preset" else opts.drafter
    drafter_ref = None if drafter_ref == "none" else drafter_ref
    missing, target_dir, drafter_dir = [], None, None
    try:
        target_dir, preset = resolve_target(opts.target)
    except DFlashError as e:
        missing.append(f"target: {e}")
    if drafter_ref is not None:
        try:
            drafter_dir = resolve_checkpoint(drafter_ref)
        except DFlashError as e:
            missing.append(f"drafter: {e}")
    if missing and not missing_ok:
        raise DFlashError("; ".join(missing) if len(missing) == 1 else
                          f"{len(missing)} checkpoints missing: " + "; ".join(missing))
    target_config = TargetConfig.from_dir(target_dir) if target_dir else None
    if target_config and opts.max_context is not None:
        target_config.check_max_context(opts.max_context)
    block_size = opts.block_size
    drafter_config = None
    if drafter_dir is not None:
        drafter_config = DrafterConfig.from_dir(drafter_dir)
        if target_config:
            drafter_config.check_against(target_config, str(drafter_dir))
        if block_size != AUTO_BLOCK_SIZE and block_size > drafter_config.block_size:
            raise DFlashError(f"--block-size {block_size} is larger than the drafter supports "
                              f"({drafter_config.block_size})")
        widest = drafter_config.block_size if block_size == AUTO_BLOCK_SIZE else block_size
        if opts.max_context is not None:
            check_context_room(opts.max_context, widest)
        if opts.runtime == "trtllm":  # before hours of quantizing, not when the options are written
            from builder.trtllm import TrtllmOptions, check_token_budget, max_draft_len_for

            check_token_budget(opts.max_batch_size, max_draft_len_for(widest), TrtllmOptions().max_num_tokens)
    elif drafter_ref is not None:
        pass  # missing: the dry run says so; the block size is checked once it is there
    elif block_size == AUTO_BLOCK_SIZE:
        block_size = 1  # nothing to choose from: plain decoding (the plan says so)
    elif block_size != 1:
        raise DFlashError(f"--block-size {block_size} needs a drafter")
    check_parallel_split(opts, target_config.shape if target_config else None,
                         drafter_config.shape if drafter_config else None)
    name = preset.name if preset else None
    max_context = opts.max_context or default_max_context(opts.runtime, name, target_config)
    return Inputs(target_dir, drafter_dir, drafter_config, name, block_size, max_context,
                  target_ref, drafter_ref, tuple(missing))


def kv_context(preset: str | None) -> int:
    """The context per batch place that the default KV pool is sized for (Preset.kv_context)."""
    return PRESETS[preset].kv_context if preset else DEFAULT_KV_CONTEXT


def default_max_context(runtime: str, preset: str | None, target_config: TargetConfig | None) -> int | None:
    """A sequence's limit without --max-context. Our runtime: the target's own, bounded by the KV pool that all
    sequences share. TensorRT-LLM reserves DFlash's context cache per batch place for max_seq_len positions, so
    there it is the pool's context per place (kv_context), as before."""
    if runtime == "trtllm":
        return kv_context(preset)
    return target_config.max_position_embeddings if target_config else None


def fetch_command(inputs: Inputs) -> str:
    """One command that fetches every missing checkpoint named by a hub id (a missing path is for the user)."""
    refs = [ref for ref, found in ((inputs.target_ref, inputs.target_dir), (inputs.drafter_ref, inputs.drafter_dir))
            if ref and found is None and is_hub_id(ref)]
    return " && ".join(f"hf download {ref}" for ref in refs)


def check_parallel_split(opts: BuildOptions, target: TransformerShape | None,
                         drafter: TransformerShape | None) -> str | None:
    """Refuse --tensor-parallel-size and --pipeline-parallel-size that TensorRT-LLM cannot split the target and
    the drafter by (builder/trtllm.py), judged on their config.json, else on the preset's known shape.
    Returns what could not be judged (a target not here yet: the build judges it once it is), else None."""
    tp, pp = opts.tensor_parallel_size, opts.pipeline_parallel_size
    if opts.runtime != "trtllm" or (tp, pp) == (1, 1):
        return None
    from builder.trtllm import check_pipeline_stages, check_tensor_parallel

    preset = PRESETS.get(opts.target)
    if target is not None:
        check_tensor_parallel(tp, target.num_heads, target.num_kv_heads, opts.target)
        check_pipeline_stages(pp, target.num_layers, opts.target)
    elif preset is not None:
        check_tensor_parallel(tp, preset.heads, preset.kv_heads, opts.target)
        check_pipeline_stages(pp, preset.layers, opts.target)
    if drafter is not None:  # on the same GPUs, split by the same tensor-parallel mapping
        check_tensor_parallel(tp, drafter.num_heads, drafter.num_kv_heads, f"the drafter of {opts.target}")
    if target is None and preset is None:
        sizes = " and ".join(f"{flag} {n}" for flag, n in (("--tensor-parallel-size", tp),
                                                           ("--pipeline-parallel-size", pp)) if n > 1)
        return (f"{sizes} not checked against {opts.target}'s attention heads and layers: its config.json is not "
                "here (the build checks once the checkpoint is)")
    return None


def local_shape(target: str) -> TransformerShape | None:
    """The shape in a local target checkpoint's config.json (--check reads no more of it), None elsewhere."""
    config = Path(target) / "config.json"
    return TransformerShape.from_dict(read_json(config), str(config)) if config.is_file() else None


def checked_flags(opts: BuildOptions) -> str:
    """The flags check_options judged, as a command line: the target and runtime, and the others set."""
    flags = [("--target", opts.target), ("--runtime", opts.runtime)]
    flags += [(flag, value) for flag, value, default in [
        ("--drafter", opts.drafter, "preset"), ("--device", opts.device, "auto"),
        ("--max-context", opts.max_context, None),
        ("--gpu", opts.gpu, None), ("--quant", opts.quant, "none"), ("--kv-cache", opts.kv_cache, "none"),
        ("--tensor-parallel-size", opts.tensor_parallel_size, 1),
        ("--pipeline-parallel-size", opts.pipeline_parallel_size, 1),
        ("--dflash-attention", opts.dflash_attention, None),
        ("--speculative-sampling", opts.speculative_sampling, DEFAULT_SPECULATIVE_SAMPLING)] if value != default]
    return " ".join(f"{flag} {shlex.quote(str(value))}" for flag, value in flags)


def plan(inputs: Inputs, opts: BuildOptions, output: Path) -> list[str]:
    drafter = (inputs.drafter_dir or inputs.drafter_ref or "none (plain autoregressive)")
    target = inputs.target_dir or inputs.target_ref
    steps = [f"target   {target}" + (f" (preset {inputs.preset})" if inputs.preset else "")
             + ("  [MISSING]" if inputs.target_dir is None else ""),
             f"drafter  {drafter}, block size {inputs.block_size}"
             + (f" (up to {inputs.drafter.block_size})" if inputs.profiles and inputs.drafter else "")
             + ("  [MISSING]" if inputs.drafter_ref and inputs.drafter_dir is None else "")]
    if opts.quant == "none":
        steps.append(f"copy the target into {output / TARGET_DIR}")
    else:
        steps.append(f"quantize the target with ModelOpt: {opts.quant}, KV cache {opts.kv_cache}, "
                     f"{opts.calib_samples} ShareGPT calibration samples -> {output / TARGET_DIR}")
    steps.append(f"copy the drafter into {output / DRAFTER_DIR}" if inputs.drafter_ref else "no drafter to copy")
    if opts.runtime == "torch":
        steps.append(f"render the Triton model repository ({', '.join(TORCH_MODELS)}) into {output / REPOSITORY_DIR}: "
                     f"max batch {opts.max_batch_size}, context {inputs.max_context or 'as the target allows'}, KV cache "
                     f"{kv_cache_tokens(inputs, opts)} tokens, {opts.dtype} on {opts.device}, "
                     f"speculative sampling {opts.speculative_sampling}")
    else:
        steps.append(f"write TensorRT-LLM LLM-API options ({TRTLLM_OPTIONS_FILE}: DFlash, "
                     f"tp {opts.tensor_parallel_size}, "
                     f"pp {opts.pipeline_parallel_size}, max batch {opts.max_batch_size}) and render the LLM-API "
                     f"model repository into {output / REPOSITORY_DIR}; validate them where tensorrt_llm imports")
    if opts.sanity_tokens and inputs.drafter_ref is None:
        steps.append(f"sanity run: {len(SANITY_PROMPTS)} prompts x {opts.sanity_tokens} tokens, plain decoding (no "
                     "drafter to compare): the build loads and generates, tokens/s")
    elif opts.sanity_tokens:
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


def kv_cache_tokens(inputs: Inputs, opts: BuildOptions) -> int:
    """The torch runtime's KV memory in tokens: --kv-cache-tokens, else the engine's default for the build."""
    from dflash_runtime.engine_sizes import default_kv_cache_tokens

    per_place = kv_context(inputs.preset)
    return opts.kv_cache_tokens or default_kv_cache_tokens(opts.max_batch_size, inputs.max_context or per_place,
                                                           inputs.block_width, per_place)


def repository_values(inputs: Inputs, opts: BuildOptions) -> dict[str, object]:
    # Paths are relative to the repository root, so the build folder can move (a volume, a container).
    return {
        "max_batch_size": opts.max_batch_size,
        "tokenizer_dir": f"../{TARGET_DIR}",
        "target_dir": f"../{TARGET_DIR}",
        "drafter_dir": f"../{DRAFTER_DIR}" if inputs.drafter_dir else "",
        "block_size": inputs.block_size,
        "speculative_sampling": opts.speculative_sampling,
        # made by the sanity run; without one the server profiles when it starts
        "verify_profile": f"../{VERIFY_PROFILE_FILE}" if inputs.profiles and opts.sanity_tokens else "",
        "max_context": inputs.max_context,
        "max_queue_size": opts.max_queue_size,
        "kv_cache_tokens": kv_cache_tokens(inputs, opts),
        "prefill_chunk": opts.prefill_chunk,
        "prefix_caching": str(opts.prefix_caching).lower(),
        "suffix_drafts": str(opts.suffix_drafts).lower(),
        "shared_suffix_tokens": opts.shared_suffix_tokens,
        "dtype": opts.dtype,
        "device": opts.device,
        "cpu_weights": opts.cpu_weights,
        "preprocessing_instances": 1,
        "postprocessing_instances": 1,
    }


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
    for folder in remove_abandoned(output):
        print(f"build.py: note: removed {folder}, left by a build that was killed", file=sys.stderr)
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
    try:
        with partial_folder(output) as stage:  # removed on any error or interruption, unless published
            manifest = _build_into(stage, output, inputs, opts, hashes, key, started, force)
            if _stopped_by:  # a stop whose KeyboardInterrupt Python swallowed (_unraisable)
                raise KeyboardInterrupt
            publish(stage, output)
        for kept in kept_quantizations(output):  # the build holds its quantized target now
            shutil.rmtree(kept, ignore_errors=True)
    except OSError as e:
        raise DFlashError(f"writing the build failed ({e.strerror or e}: {e.filename or output.parent}); nothing "
                          "was published. Check free disk space and permissions.") from None
    return manifest


def quantization_key(opts: BuildOptions, target_hashes: dict) -> str:
    """What the quantized target depends on: the target's files and the quantizer's options."""
    return build_key({"quant": opts.quant, "kv_cache": opts.kv_cache, "calib_samples": opts.calib_samples,
                      "device": opts.device}, target_hashes)


def kept_quantizations(output: Path) -> list[Path]:
    """Quantized targets an unfinished build left beside `output` for the next run to reuse."""
    return sorted(output.parent.glob(f".{output.name}.quantized-*"))


def quantized_target(inputs: Inputs, opts: BuildOptions, output: Path, target_hashes: dict,
                     reuse: bool = True) -> tuple[Path, dict]:
    """The quantized target and its report. Quantizing takes the longest (calibration alone ran 28 minutes on
    a 2-core CPU), so it is done once per target and quantizer options: taken from the build already at
    `output` (another serving option changed) or from what an interrupted run kept beside it, else made
    and kept there until the build is published. Without `reuse` (--force) it is made again."""
    from builder.quantize import quantize_target

    key = quantization_key(opts, target_hashes)
    try:
        published = read_manifest(output).data.get("quantization") or {}
    except DFlashError:
        published = {}
    if reuse and published.get("key") == key and (output / TARGET_DIR).is_dir():
        return output / TARGET_DIR, {**published, "reused": f"from the previous build at {output}"}
    kept = output.parent / f".{output.name}.quantized-{key[:16]}"
    report_file = kept / "quantization.json"
    if reuse and report_file.is_file():
        return kept / TARGET_DIR, {**json.loads(report_file.read_text()), "reused": f"kept by an earlier run in {kept}"}
    kept.mkdir(exist_ok=True)
    report_file.unlink(missing_ok=True)  # written again last, when the target it describes is complete
    report = {**quantize_target(inputs.target_dir, kept / TARGET_DIR, opts.quant, opts.kv_cache, opts.calib_samples,
                                device=opts.device), "key": key}
    report_file.write_text(json.dumps(report, indent=2) + "\n")  # last: the kept target is complete
    return kept / TARGET_DIR, report


def _build_into(stage: Path, output: Path, inputs: Inputs, opts: BuildOptions, hashes: dict, key: str,
                started: float, force: bool) -> dict:
    quantization = None
    if opts.quant == "none":
        copy_checkpoint(inputs.target_dir, stage / TARGET_DIR)
    else:
        quantized, quantization = quantized_target(inputs, opts, output, hashes["target"], reuse=not force)
        copy_checkpoint(quantized, stage / TARGET_DIR)
    if inputs.drafter_dir:
        copy_checkpoint(inputs.drafter_dir, stage / DRAFTER_DIR)
    sanity = (sanity_run(stage, opts, inputs.drafter_dir is not None, inputs.block_size, inputs.max_context)
              if opts.sanity_tokens else None)
    trtllm = None
    if opts.runtime == "torch":
        render_repository(stage / REPOSITORY_DIR, repository_values(inputs, opts))
    else:
        trtllm = write_trtllm_artifacts(stage, inputs, opts, (sanity or {}).get("verify_profile"))
    manifest = {
        "build_key": key,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs": {"target": opts.target, "target_dir": str(inputs.target_dir), "preset": inputs.preset,
                   "drafter_dir": str(inputs.drafter_dir) if inputs.drafter_dir else None, "file_sha256": hashes},
        "options": {**asdict(opts), "block_size": inputs.block_size, "max_context": inputs.max_context,
                    "kv_cache_tokens": kv_cache_tokens(inputs, opts), "reasoning_parser": reasoning_parser(opts)},
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


def write_trtllm_artifacts(stage: Path, inputs: Inputs, opts: BuildOptions, verify_profile: dict | None) -> dict:
    """LLM-API options for TensorRT-LLM's PyTorch backend (DFlash) and the LLM-API model repository.

    The options name the build's parts relative to the build folder ("./drafter"), so the build can move to
    the volume a server mounts: trtllm-serve runs in the build folder, dflash-serve resolves them where the
    build is. Validation reads the staged copies. Block size auto becomes a draft_len_schedule where the
    sanity run profiled a GPU (a CPU profile says nothing of TensorRT-LLM on a GPU); otherwise the drafter's
    whole block.
    """
    from builder.trtllm import (TrtllmOptions, dflash_context_buffer_bytes, draft_len_schedule, llm_api_options,
                                render_trtllm_repository, serve_command, validate_llm_args,
                                write_extra_llm_api_options)

    drafter = inputs.drafter  # check_options refused --runtime trtllm without one
    schedule = None
    if inputs.profiles and verify_profile and opts.device.startswith("cuda"):
        schedule = draft_len_schedule(verify_profile["seconds"], verify_profile["acceptance_rates"])
    options = llm_api_options(
        drafter=in_build(DRAFTER_DIR), block_size=drafter.block_size if inputs.profiles else inputs.block_size,
        options=TrtllmOptions(tensor_parallel_size=opts.tensor_parallel_size,
                              pipeline_parallel_size=opts.pipeline_parallel_size,
                              max_batch_size=opts.max_batch_size, max_seq_len=inputs.max_context,
                              dflash_attention_backend=opts.dflash_attention),
        mask_token_id=drafter.mask_token_id, target_layer_ids=list(drafter.target_layer_ids), schedule=schedule)
    write_extra_llm_api_options(options, stage / TRTLLM_OPTIONS_FILE)
    render_trtllm_repository(stage / REPOSITORY_DIR, options, model=in_build(TARGET_DIR))
    validation = validate_llm_args(options, model=stage / TARGET_DIR, speculative_model=stage / DRAFTER_DIR)
    context_cache = dflash_context_buffer_bytes(options, json.loads((stage / DRAFTER_DIR / "config.json").read_text()))
    return {"options": options, "options_file": TRTLLM_OPTIONS_FILE, "gpu": opts.gpu,
            "validated": validation.validated, "validation": validation.message,
            "dflash_context_cache_gib": None if context_cache is None else round(context_cache / 2 ** 30, 2),
            "serve_command": serve_command(in_build(TARGET_DIR), TRTLLM_OPTIONS_FILE)}  # run in the build folder


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"cannot create the output's parent folder {folder}: {e.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise DFlashError(f"the output's parent folder {folder} is not writable")


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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; a deleted Job, a timeout: ended alike
_stopped_by: list[int] = []


def _interrupted(signum, frame):
    # remembered as well as raised: raised inside a native library's callback, the interrupt comes out as that
    # library's error (safetensors' load_file: "could not determine the shape of object type ...", seen in a test run)
    _stopped_by.append(signum)
    raise KeyboardInterrupt


def _unraisable(info) -> None:
    """A stop signal that lands in a __del__ (regex's Group.__del__, seen in a test run) raises there, and Python
    prints that KeyboardInterrupt as a traceback and goes on: quiet here, since build() stops before publishing."""
    if not (_stopped_by and isinstance(info.exc_value, KeyboardInterrupt)):
        sys.__unraisablehook__(info)


def _import_native_extensions() -> None:
    """Import now what a build would import lazily from nanobind extensions (triton, under torch._dynamo, which the
    first model made on the meta device loads; xgrammar): a stop signal raised inside such an import ends the
    process in std::terminate instead of KeyboardInterrupt (seen in a test run)."""
    import importlib.util

    import torch._dynamo  # noqa: F401

    if importlib.util.find_spec("xgrammar") is not None:
        import xgrammar  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _import_native_extensions()
    previous = {signum: signal.signal(signum, _interrupted) for signum in STOP_SIGNALS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _unraisable
    _stopped_by.clear()
    try:
        return _run(args)
    finally:
        sys.unraisablehook = previous_hook
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    output = args.output or Path("builds") / Path(args.target).name
    training = None
    try:
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
            unchecked = check_parallel_split(opts, local_shape(opts.target), None)
            if unchecked:
                print(f"build.py: note: {unchecked}", file=sys.stderr)
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
            inputs = None if training else resolve_inputs(opts, missing_ok=True)
            steps = ([f"train a drafter: dflash-train-drafter, resumable in {training.output}",
                      "build with the trained drafter"] if training else plan(inputs, opts, output))
            print("plan:\n" + "\n".join(f"  {n}. {s}" for n, s in enumerate(steps, 1)))
            if inputs and inputs.missing:
                print("missing:\n" + "\n".join(f"  {m}" for m in inputs.missing))
                fetch = fetch_command(inputs)
                raise DFlashError(f"{len(inputs.missing)} checkpoint{'s' * (len(inputs.missing) > 1)} missing; "
                                  + (f"fetch on a connected machine, then build: {fetch}" if fetch
                                     else "give their folders"))
            return 0
        if training is not None:
            from dflash_training.train_drafter import train

            train(training)
        manifest = build(opts, output, force=args.force)
    except Exception as e:
        if not _stopped_by:  # a failure, not a stop that a native library reported as an error of its own
            if isinstance(e, DFlashError):
                print(f"build.py: error: {e}", file=sys.stderr)
                return 2
            raise
        return _say_interrupted(output, training)
    except KeyboardInterrupt:
        return _say_interrupted(output, training)
    print(summary(manifest, output))
    return 0


def _say_interrupted(output: Path, training) -> int:
    kept = [k for k in kept_quantizations(output.resolve()) if (k / "quantization.json").is_file()]
    print("\nbuild.py: interrupted; nothing was published" + (
        f"; the quantized target is kept in {kept[-1]} and the next run with the same target and --quant, "
        "--kv-cache, --calib-samples reuses it" if kept else "")
        + ("; training resumes from its last checkpoint" if training else ""), file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
