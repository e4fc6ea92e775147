"""``python -m tokenspeed_aio serve`` as launch scripts call it: other engines' flag names,
``--help`` with every default, refused and bad flags in one line, a hub id resolved from
the local HF cache offline, a checkpoint saved by transformers served with no flags (its
generation_config.json's defaults applied), the API key from the environment, the access
log, a port in use failing before the model loads, and nothing left in the temp directory
nor a leak report at exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from helpers.instruct import GENERATION_DEFAULTS, hub_cache, make_instruct_checkpoint
from helpers.server import wait_healthy

from tokenspeed_aio.bench.ports import free_port
from tokenspeed_aio.cli import build_parser
from tokenspeed_aio.engine_flags import engine_args_from

REPO = "test-org/tiny-instruct"
SMALL = ["--num-kv-blocks=256", "--page-size=4", "--max-num-seqs=8"]


def serve_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "tokenspeed_aio", "serve", *flags]


def run(*flags: str, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(serve_cmd(*flags), capture_output=True, text=True, timeout=timeout,
                          env=env)  # fmt: skip


@pytest.mark.parametrize(
    "flags, field, value",
    [
        (["--tensor-parallel-size", "2"], "tp", 2),
        (["--tp-size", "2"], "tp", 2),
        (["--data-parallel-size", "2"], "dp", 2),
        (["--dp-size", "2"], "dp", 2),
        (["--max-num-batched-tokens", "1024"], "chunked_prefill_size", 1024),
        (["--context-length", "512"], "max_model_len", 512),
        (["--mem-fraction-static", "0.8"], "gpu_memory_utilization", 0.8),
        (["--model-path", "/m"], "model", "/m"),
        (["--served-model-name", "a", "b"], "served_model_name", ["a", "b"]),
        (["--served-model-name", "a"], "served_model_name", "a"),
        (["--generation-config", "vllm"], "generation_config", "vllm"),
        (["--enable-deterministic-inference"], "enable_deterministic_inference", True),
    ],
)
def test_other_engines_flag_names_are_aliases(flags, field, value):
    ns = build_parser().parse_args(["serve", *flags])
    assert getattr(engine_args_from(ns), field) == value


def test_disable_log_requests_and_help_shows_every_default():
    ns = build_parser().parse_args(["serve", "--disable-log-requests"])
    assert ns.disable_log_requests
    out = run("--help").stdout
    for flag, default in [("--max-num-seqs", "256 on CPU;"), ("--port", "8000)"),
                          ("--page-size", "16)"), ("--generation-config", "auto)"),
                          ("--host", "127.0.0.1)"), ("--max-model-len", "the model's")]:  # fmt: skip
        block = " ".join(out[out.index(f"\n  {flag}") + 3 :].split("\n  --", 1)[0].split())
        assert f"(default: {default}" in block, flag
        assert block.count("(default:") == 1, block  # a flag's own words are never doubled


def test_trust_remote_code_is_refused_saying_why():
    result = run("--trust-remote-code")
    assert result.returncode == 2
    assert "never runs a checkpoint's custom model code" in result.stderr


@pytest.mark.parametrize(
    "model, says",
    [("/nonexistent/dir", "no such directory"), ("not a model", "not a Hugging Face hub id"),
     ("nobody/missing", "not in the local Hugging Face cache")],
)  # fmt: skip
def test_a_bad_model_is_one_line(model, says, tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = run("--model", model, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.stderr


def test_a_port_in_use_fails_before_the_model_loads(ckpt):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = run(f"--model={ckpt('llama')}", f"--port={port}", *SMALL)
        elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in result.stderr
    assert "Loading weights" not in result.stderr
    assert elapsed < 20  # the interpreter start and imports; no rank was started


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-home")
    checkpoint = make_instruct_checkpoint(root.parent / "instruct")
    return hub_cache(root, REPO, checkpoint)


async def test_a_saved_checkpoint_from_the_hub_cache_serves_with_its_defaults(hub_home, tmp_path):
    """serve ORG/NAME with HF_HUB_OFFLINE=1: the cached snapshot (sharded safetensors,
    chat_template.jinja, generation_config.json) serves with no template or sampling flags;
    a request that sets no sampling field samples with the checkpoint's defaults. The API key
    comes from TOKENSPEED_API_KEY; the access log has a line per request; shutdown leaves no
    ipc file in the temp dir and prints no leak report."""
    port, tmp = free_port(), tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp),
           "TOKENSPEED_API_KEY": "env-key"}  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(serve_cmd(REPO, f"--port={port}", *SMALL), stdout=out,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, lambda: proc.poll() is None)
        assert httpx.get(f"{base}/v1/models").status_code == 401
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="env-key", max_retries=0)
        async with client:
            assert [m.id for m in (await client.models.list()).data] == [REPO]
            kw = dict(model=REPO, messages=[{"role": "user", "content": "hi"}], max_tokens=12)
            implicit = await client.chat.completions.create(**kw, seed=7)
            explicit = await client.chat.completions.create(**kw, seed=7, **{
                k: v for k, v in GENERATION_DEFAULTS.items() if k != "top_k"},
                extra_body={"top_k": GENERATION_DEFAULTS["top_k"]})  # fmt: skip
            api_defaults = await client.chat.completions.create(
                **kw, seed=7, temperature=1.0, top_p=1.0, extra_body={"top_k": 0}
            )
        text = implicit.choices[0].message.content
        assert text == explicit.choices[0].message.content
        assert text != api_defaults.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    assert "tokenspeed_aio.access" in output and '"POST /v1/chat/completions" 200' in output
    assert "leaked" not in output
    assert not [p for p in tmp.iterdir() if p.name.startswith("tokenspeed-")]
