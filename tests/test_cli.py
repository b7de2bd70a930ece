"""dflash-generate: JSON output, the autoregressive mode, and clear errors for bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hf_greedy
from dflash_tools.cli import main


def generate(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_is_lossless_and_complete(tiny, capsys):
    target, drafter = map(str, tiny)
    code, out, _ = generate(capsys, "--target", target, "--drafter", drafter, "--prompt-ids", "3,17,99",
                            "--max-new-tokens", "30", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["output_ids"] == hf_greedy(tiny[0], [3, 17, 99], 30)
    assert result["block_size"] == "auto"  # the default: each step picks its verify length
    assert len(result["verify_lengths"]) == len(result["acceptance_lengths"])
    assert set(result["verify_lengths"]) <= set(range(1, 17))  # on a CPU any length up to the block
    assert all(a <= k for a, k in zip(result["acceptance_lengths"], result["verify_lengths"]))
    # each step under one draft source, and `--no-suffix-drafts` drafts with the drafter alone, to the same tokens
    assert sum(s["steps"] for s in result["draft_sources"].values()) == len(result["verify_lengths"])
    code, out, _ = generate(capsys, "--target", target, "--drafter", drafter, "--prompt-ids", "3,17,99",
                            "--max-new-tokens", "30", "--json", "--no-suffix-drafts")
    alone = json.loads(out)
    assert alone["output_ids"] == result["output_ids"] and "suffix" not in alone["draft_sources"]
    assert sum(result["acceptance_lengths"]) >= len(result["output_ids"]) - 1
    assert result["tokens_per_second"] > 0 and "text" not in result  # the tiny target has no tokenizer

    code, out, _ = generate(capsys, "--target", target, "--prompt-ids", "3,17,99", "--max-new-tokens", "30",
                            "--block-size", "1", "--json")
    plain = json.loads(out)
    assert code == 0 and plain["output_ids"] == result["output_ids"] and set(plain["acceptance_lengths"]) == {1}


@pytest.mark.parametrize("argv,message", [
    (["--prompt-ids", ""], "empty prompt"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1", "--block-size", "32"], "larger than the drafter supports"),
    (["--prompt-ids", "1", "--top-p", "0"], "top_p"),
    (["--prompt-ids", "1", "--top-p", "1.5"], "top_p"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt-ids", ",".join(["5"] * 20), "--max-context", "16"], "context limit"),
    (["--prompt", "hello"], "no tokenizer"),
    (["--prompt-ids", "1", "--drafter", "/nonexistent/drafter"], "checkpoint folder /nonexistent/drafter does not "
                                                                   "exist"),
    (["--prompt-ids", "1", "--drafter", __file__], "is a file: give the checkpoint's folder"),
    (["--prompt-ids", "1", "--drafter", "no-org/no-drafter"], "hf download no-org/no-drafter"),  # a hub id
    (["--prompt-ids", "1", "--max-context", "100000"], "--max-context 100000 is beyond this target's 1024 positions"),
])
def test_bad_input_is_a_clear_error(tiny, capsys, argv, message):
    code, out, err = generate(capsys, "--target", str(tiny[0]), "--drafter", str(tiny[1]), *argv)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["0", "-3", "fast", "2.5"])
def test_bad_block_size_is_a_usage_error(tiny, capsys, value):
    with pytest.raises(SystemExit) as exit_:
        generate(capsys, "--target", str(tiny[0]), "--prompt-ids", "1", "--block-size", value)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "block size must be 'auto' or an integer >= 1" in err
    assert err.startswith("dflash-generate: error: ") and err.count("\n") == 1, err  # one line, no usage text


def test_auto_without_a_drafter_is_plain_decoding(tiny, capsys):
    code, out, err = generate(capsys, "--target", str(tiny[0]), "--drafter", "none", "--prompt-ids", "3,17,99",
                              "--max-new-tokens", "8", "--json")
    result = json.loads(out)
    assert code == 0 and "block size auto means plain decoding" in err
    assert result["block_size"] == 1 and set(result["verify_lengths"]) == {1}
    assert result["output_ids"] == hf_greedy(tiny[0], [3, 17, 99], 8)


def test_unknown_preset_lists_the_known_ones(capsys):
    code, _, err = generate(capsys, "--target", "qwen9-1t", "--prompt-ids", "1")
    assert code == 2 and "neither a preset" in err and "qwen3-8b" in err


def test_console_script_exits_nonzero_without_traceback(tiny):
    exe = Path(sys.executable).parent / "dflash-generate"  # installed beside the interpreter, on PATH or not
    assert exe.is_file(), "the package's console script is not installed"
    run = subprocess.run([str(exe), "--target", str(tiny[0]), "--prompt-ids", "1", "--top-p", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "top_p must be in (0, 1]" in run.stderr and "Traceback" not in run.stderr
