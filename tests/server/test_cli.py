"""`moelora demo` (what `make run` runs) and its --serve variant, as subprocesses; the engine
flags and the one-line config errors, in process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moelora
from moelora import cli, demo
from moelora.config import EngineConfig
from moelora.errors import ConfigError
from moelora.models.shapes import shape_config, write_config_folder

from .conftest import API_KEY, Server, _free_port


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-cache")
    demo.ensure_demo(root / "demo")
    return root


def _run(cache: Path, *args: str) -> str:
    env = {**os.environ, "MOELORA_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "moelora.cli", "demo", "--device", "cpu", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_demo_prints_each_adapter(cache: Path) -> None:
    out = _run(cache)
    for name in ("sql", "chat", "base"):
        assert f"[{name:>5}]" in out


def test_demo_serve_queries_each_adapter_then_stops(cache: Path) -> None:
    """With async scheduling (the default) and without it: the same answers over HTTP."""
    answers = []
    for mode in ("--async-scheduling", "--no-async-scheduling"):
        port = _free_port()
        out = _run(cache, "--serve", "--once", "--port", str(port), mode)
        for name in ("sql", "chat", "base"):
            assert f"[{name:>5}]" in out
        assert f"curl http://127.0.0.1:{port}/v1/completions" in out
        answers.append([line for line in out.splitlines() if line.lstrip().startswith("[")])
    assert answers[0] == answers[1] and len(answers[0]) >= 3
    assert "OpenAI(base_url=" in out


def _printed_commands(printed: str) -> list[str]:
    """The shell commands among the printed hints: each starts on a line indented by two spaces
    and goes on while its line ends with a backslash."""
    commands: list[str] = []
    goes_on = False
    for line in printed.splitlines():
        if goes_on:
            commands[-1] += "\n" + line
        elif line.startswith("  ") and not line.startswith("   "):
            commands.append(line[2:])
        else:
            continue
        goes_on = line.endswith("\\")
    return commands


def _shell_without_the_venv() -> dict[str, str]:
    """The environment of a shell where the venv is not activated, as after `make run`."""
    venv_bin = Path(sys.executable).parent
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p) != venv_bin]
    env = {**os.environ, "PATH": os.pathsep.join(path)}
    env.pop("VIRTUAL_ENV", None)
    return env


def _check_hint_output(command: str, out: str) -> None:
    if "/v1/models" in command:
        assert "sql" in {m["id"] for m in json.loads(out)["data"]}
    elif "curl -N" in command:  # the streamed chat: bounded by its max_tokens
        events = [line for line in out.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", out[-300:]
        body = json.loads(command.split("-d '", 1)[1].rstrip("'"))
        assert "max_tokens" in body, f"a stream of {len(events)} events: no max_tokens"
        assert len(events) <= body["max_tokens"] + 3, f"{len(events)} events for {body}"
    elif "/v1/completions" in command:
        assert json.loads(out)["usage"]["completion_tokens"] >= 1
    elif "/metrics" in command:
        assert "moelora_requests_total" in out
    else:  # the Python line, which printed the (sampled) text
        assert "OpenAI(" in command and out.endswith("\n"), out


def test_the_printed_hints_run_as_printed(server: Server, capsys: pytest.CaptureFixture) -> None:
    cli._print_hints(server.url, API_KEY, forever=False)
    commands = _printed_commands(capsys.readouterr().out)
    assert len(commands) == 5, commands
    failures = []
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command],
            env=_shell_without_the_venv(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        try:
            assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-1000:]}"
            assert '"error"' not in done.stdout, done.stdout[-1000:]
            _check_hint_output(command, done.stdout)
        except AssertionError as e:
            failures.append(f"{command}\n  -> {e}")
    assert not failures, "\n".join(failures)


def test_bench_reports_throughput_and_refuses_unknown_adapters(cache: Path) -> None:
    env = {**os.environ, "MOELORA_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "moelora.cli", "bench", "demo", "--device", "cpu"]
    sizes = ["--num-prompts", "6", "--input-len", "12", "--output-len", "5"]
    done = subprocess.run(
        [*cmd, *sizes, "--lora", "sql", "--lora", "base"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 x (12 in, 5 out)" in done.stdout and "['sql', 'base']" in done.stdout
    assert "output tokens/s" in done.stdout
    bad = subprocess.run(
        [*cmd, *sizes, "--lora", "nope"], env=env, capture_output=True, text=True, timeout=180
    )
    assert bad.returncode != 0 and "'nope'" in bad.stderr


CPU = ["--device", "cpu", "--max-model-len", "64", "--num-pages", "32"]
SIZES = ["--num-prompts", "3", "--input-len", "6", "--output-len", "3"]
TINY = ["--load-format", "dummy", "--shape", "tiny-qwen3-moe"]


def _bench(*args: str) -> None:
    cli.main(["bench", *CPU, *SIZES, *args])


def test_bench_runs_a_named_shape_with_random_loras(capsys: pytest.CaptureFixture) -> None:
    _bench(*TINY, "--random-lora", "r1:4", "--random-lora", "r2")
    out = capsys.readouterr().out
    assert "model: tiny-qwen3-moe (dummy weights) on cpu" in out
    assert "3 x (6 in, 3 out), adapters cycled: ['r1', 'r2']" in out  # the default cycle
    assert "output tokens/s" in out


@pytest.mark.parametrize("given", ["file", "folder"])
def test_bench_runs_an_hf_config(given: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = write_config_folder(shape_config("tiny-qwen3-moe", num_layers=1), tmp_path)
    path = folder / "config.json" if given == "file" else folder
    _bench(
        "--load-format",
        "dummy",
        "--hf-config",
        str(path),
        "--random-lora",
        "r:2",
        "--lora",
        "base",
        "--lora",
        "r",
    )
    out = capsys.readouterr().out
    assert f"model: {path} (dummy weights) on cpu" in out and "['base', 'r']" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shape", "tiny-qwen3-moe"], "--shape gives a model without weights: add --load-format"),
        ([*TINY, "--hf-config", "c.json"], "give one of the model argument, --shape and --hf-c"),
        (["demo", *TINY], "give one of the model argument, --shape and --hf-config, not"),
        ([], "expected a model folder, 'demo', --shape NAME or --hf-config PATH"),
        (
            ["--load-format", "dummy", "--hf-config", "/nonexistent/config.json"],
            "--hf-config '/nonexistent/config.json': expected a config.json",
        ),
        ([*TINY, "--random-lora", "r:0"], "--random-lora 'r:0': expected NAME or NAME:RANK"),
        ([*TINY, "--random-lora", "r:x"], "--random-lora 'r:x': expected"),
        ([*TINY, "--random-lora", ":4"], "--random-lora ':4': expected"),
        (
            [*TINY, "--random-lora", "r:65"],
            "moelora: random adapter 'r': rank=65 is invalid: expected 1 .. max_lora_rank=64",
        ),
    ],
)
def test_bench_refuses_a_model_it_cannot_build(args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        _bench(*args)
    assert message in str(exit_.value.code)


KNOBS = {
    "max_num_seqs": 7,
    "max_num_batched_tokens": 96,
    "page_size": 8,
    "num_pages": 40,
    "max_graph_bs": 12,
}


def test_engine_flags_reach_the_config_and_the_llm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in KNOBS.items()]
    args = cli._parser().parse_args(["generate", str(tmp_path), "--prompt", "x", *flags])
    config = cli._engine_config(args)
    assert {name: getattr(config, name) for name in KNOBS} == KNOBS
    defaults = cli._engine_config(
        cli._parser().parse_args(["generate", str(tmp_path), "--prompt", "x"])
    )
    assert defaults == EngineConfig(model=str(tmp_path))  # the flags' defaults are the config's

    seen = {}
    monkeypatch.setattr(moelora, "LLM", lambda model, **options: seen.update(options))
    cli._llm(config)
    assert {name: seen[name] for name in KNOBS} == KNOBS


def test_a_bad_engine_flag_exits_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", str(tmp_path), "--prompt", "x", "--page-size", "0"])
    assert str(exit_.value.code).startswith("moelora: page_size=0 is invalid: expected")


def test_cuda_without_cuda_exits_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        EngineConfig(model=str(tmp_path), device="cuda").resolved()
    # The config is valid; resolved() refuses it when the engine is built, inside the command.
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", str(tmp_path), "--prompt", "x", "--device", "cuda"])
    message = str(exit_.value.code)
    assert message.startswith("moelora: device='cuda'") and "CUDA is not available" in message


@pytest.mark.parametrize("device", ["cuda:x", "gpu", "cuda:-1", "cpu:"])
def test_a_malformed_device_is_refused(tmp_path: Path, device: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"device={device!r} is invalid")):
        EngineConfig(model=str(tmp_path), device=device)


def test_a_cuda_index_past_the_last_gpu_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert EngineConfig(model=str(tmp_path), device="cuda:1").resolved().device == "cuda:1"
    with pytest.raises(ConfigError, match=r"device='cuda:2' is invalid: .* cuda:0 \.\. cuda:1"):
        EngineConfig(model=str(tmp_path), device="cuda:2").resolved()
