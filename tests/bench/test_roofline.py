"""The roofline calculator against published model sizes and hand arithmetic."""

from __future__ import annotations

import pytest

from tokenspeed_aio.bench.roofline import ModelBytes, decode_floor, measure_bandwidth
from tokenspeed_aio.bench.shapes import shape_config
from tokenspeed_aio.model.config import ModelConfig


def shape_bytes(shape: str, dtype: str = "bfloat16") -> ModelBytes:
    return ModelBytes.of(ModelConfig.from_dict(shape_config(shape)), dtype)


def test_llama_3_1_8b_bf16_weighs_16_06_gb():
    b = shape_bytes("llama-8b")
    assert b.total_weight_bytes == 2 * 8_030_261_248  # Llama-3.1-8B's parameter count
    assert b.total_weight_bytes / 1e9 == pytest.approx(16.06, abs=0.005)
    # The untied embedding table is read only row by row in a decode step.
    assert b.step_weight_bytes == b.total_weight_bytes - 2 * 128256 * 4096
    assert b.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128


def test_qwen3_8b_bf16_counts_its_qk_norms():
    b = shape_bytes("qwen3-8b")
    assert b.total_weight_bytes == 2 * 8_190_735_360
    assert b.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2


def test_decode_floor_is_bytes_over_bandwidth():
    b = shape_bytes("llama-8b")
    bw = 4.28e12
    one = decode_floor(b, concurrency=1, input_len=1024, output_len=1024, bandwidth=bw)
    first = b.step_weight_bytes + b.embedding_row_bytes + 1025 * b.kv_bytes_per_token
    assert one["step_bytes_first"] == first
    assert one["step_floor_ms_first"] == pytest.approx(first / bw * 1e3)
    # Batch 1 of an 8B bf16 model on an H200: about 3.5-3.8 ms per token.
    assert 3.4 < one["step_floor_ms_mean"] < 3.9
    assert one["expected_output_tokens_per_s"] == pytest.approx(1e3 / one["step_floor_ms_mean"])
    many = decode_floor(b, concurrency=64, input_len=1024, output_len=1024, bandwidth=bw)
    mean_ctx = 1024 + 1024 / 2  # contexts grow from 1025 to 2047 tokens
    expected = (
        b.step_weight_bytes + 64 * (b.embedding_row_bytes + mean_ctx * b.kv_bytes_per_token)
    ) / bw
    assert many["step_floor_ms_mean"] == pytest.approx(expected * 1e3)
    assert many["expected_output_tokens_per_s"] == pytest.approx(64 / expected)
    halved = decode_floor(b, concurrency=64, input_len=1024, output_len=1024, bandwidth=bw, tp=2)
    assert halved["step_floor_ms_mean"] == pytest.approx(many["step_floor_ms_mean"] / 2)


def test_tied_embeddings_are_read_whole_as_the_lm_head():
    b = ModelBytes.of(
        ModelConfig.from_dict(shape_config("tiny") | {"tie_word_embeddings": True}), "float32"
    )
    assert b.step_weight_bytes == b.total_weight_bytes
    assert b.step_bytes([10, 10]) == b.total_weight_bytes + 20 * b.kv_bytes_per_token


def test_cpu_bandwidth_is_measured_and_labelled_as_cpu():
    bw = measure_bandwidth("cpu", size_bytes=8 << 20, iters=3)
    assert bw["bytes_per_s"] > 1e8
    assert "CPU" in bw["method"] and bw["device"] == "CPU host memory"
