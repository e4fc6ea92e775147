import json

import pytest
import torch
from tokenspeed_kernels import fp8_gemm, gemv, gemv_rope_kv, skinny_gemm, tuning

H200 = "NVIDIA_H200"
# Tables whose H200 file is empty: not measured on an H200 yet, so the engine takes the
# unfused path there (docs/performance.md).
EMPTY_ON_H200: set[str] = set()
FILES = sorted(tuning.CONFIG_DIR.glob("*/device_name=*.json"))


def _h200_files() -> dict:
    """The shipped H200 tables, read straight from their files."""
    return {k: tuning.read(k, tuning.path(k, H200)) for k in tuning.TABLES}


@pytest.fixture(autouse=True)
def _fresh_lookups(monkeypatch):
    """No override from the environment, and no name or table cached across tests."""
    monkeypatch.delenv(tuning.DEVICE_NAME_ENV, raising=False)
    tuning.clear_cache()
    yield
    tuning.clear_cache()


def _accessors(device=None) -> dict:
    """Each table as the kernel modules hand it out, by table name."""
    return {
        "gemv": gemv.configs(device),
        "gemv_silu_mul": gemv.configs(device, silu_mul=True),
        "gemv_norm": gemv.norm_configs(device),
        "gemv_rope_kv": gemv_rope_kv.rope_kv_configs(device),
        "skinny_gemm": skinny_gemm.configs(device),
        "skinny_gemm_silu_mul": skinny_gemm.configs(device, silu_mul=True),
        "fp8_gemv": gemv.fp8_configs(device),
        "fp8_gemm": fp8_gemm.configs(device),
        "fp8_gemm_silu_mul": fp8_gemm.silu_mul_configs(device),
    }


def test_every_table_ships_an_h200_file():
    assert {(f.parent.name, f.name) for f in FILES} >= {
        (name, f"device_name={H200}.json") for name in tuning.TABLES
    }


@pytest.mark.parametrize("file", FILES, ids=lambda f: f"{f.parent.name}/{f.name}")
def test_every_file_parses_with_its_tables_fields_in_the_writers_format(file):
    kernel = file.parent.name
    assert kernel in tuning.TABLES, f"{file}: no table of that name"
    configs = tuning.read(kernel, file)  # checks the header, every arity and every type
    fields = tuning.TABLES[kernel]
    for key, config in configs.items():
        assert len(key) == len(fields.key) and len(config) == len(fields.config)
        for name, value in (*zip(fields.key, key), *zip(fields.config, config)):
            assert type(value) is (bool if name in tuning.FLAGS else int), (key, name)
    assert file.read_text() == tuning.dumps(kernel, configs)


def test_the_h200_lookup_hands_out_the_shipped_files():
    for kernel, expected in _h200_files().items():
        assert bool(expected) != (kernel in EMPTY_ON_H200), f"{kernel}: the H200 table's entries"
        assert dict(tuning.table(kernel, device_name=H200)) == expected, kernel


def test_the_override_hands_the_kernels_the_h200_tables_on_the_cpu(monkeypatch):
    monkeypatch.setenv(tuning.DEVICE_NAME_ENV, H200)
    tuning.clear_cache()
    assert tuning.device_name_of(torch.device("cpu")) == H200
    assert {k: dict(v) for k, v in _accessors(torch.device("cpu")).items()} == _h200_files()
    assert gemv_rope_kv.rope_kv_config(6144, 4096) == (8, 1024, 4, 1, True)


def test_the_cpu_and_unknown_gpus_have_empty_tables(monkeypatch):
    assert tuning.device_name_of(torch.device("cpu")) == tuning.CPU
    assert all(len(t) == 0 for t in _accessors(torch.device("cpu")).values())
    for kernel in tuning.TABLES:
        assert tuning.table(kernel, device_name="Some_Other_GPU") == {}
    monkeypatch.setenv(tuning.DEVICE_NAME_ENV, "Some_Other_GPU")
    tuning.clear_cache()
    assert all(len(t) == 0 for t in _accessors().values())
    # The fused qkv product then falls back to the built-in tiles, halved per head half.
    block_n, *rest = gemv.NORM_DEFAULT
    assert gemv_rope_kv.rope_kv_config(6144, 4096) == (block_n // 2, *rest)


def test_a_gpu_name_is_looked_up_once_per_device_with_underscores(monkeypatch):
    calls = []

    def get_device_name(device=None):
        calls.append(device)
        return "NVIDIA H200"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", get_device_name)
    device = torch.device("cuda", 0)
    tables = [gemv.configs(device) for _ in range(3)]
    assert len(calls) == 1 and tuning.device_name_of(device) == H200
    assert all(t is tables[0] for t in tables)  # parsed once, the same mapping every step
    assert dict(tables[0]) == _h200_files()["gemv"]
    with pytest.raises(TypeError):
        tables[0][(1, 1)] = (1, 1, 1, 1)  # read-only: a caller cannot change the cache


def test_write_then_read_round_trips_exactly(tmp_path):
    configs = {(96, 256, False): (4, 128, 4, 1, True), (2048, 64, True): (16, 64, 8, 3, False)}
    file = tuning.write("gemv_norm", configs, device_name="Test_GPU", directory=tmp_path)
    assert file == tmp_path / "gemv_norm" / "device_name=Test_GPU.json"
    assert tuning.read("gemv_norm", file) == configs
    text = file.read_text()
    assert json.loads(text)["configs"] == {
        "96,256,false": [4, 128, 4, 1, True],
        "2048,64,true": [16, 64, 8, 3, False],
    }
    reordered = dict(reversed(configs.items()))
    tuning.write("gemv_norm", reordered, device_name="Test_GPU", directory=tmp_path)
    assert file.read_text() == text  # sorted by key: the same bytes whatever the order
    tuning.write("gemv", {}, device_name="Test_GPU", directory=tmp_path)
    assert tuning.read("gemv", tmp_path / "gemv" / "device_name=Test_GPU.json") == {}


def test_update_writes_winners_removes_losers_and_keeps_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    shipped = {(64, 64, 16): (16, 64, 1, 4, 3), (64, 64, 32): (16, 64, 2, 4, 3)}
    tuning.write("skinny_gemm", shipped, device_name="Test_GPU")
    assert len(tuning.table("skinny_gemm", device_name="Test_GPU")) == 2
    picks = {(64, 64, 32): None, (128, 64, 64): (32, 64, 1, 8, 4)}
    tuning.update("skinny_gemm", picks, device_name="Test_GPU")
    assert dict(tuning.table("skinny_gemm", device_name="Test_GPU")) == {
        (64, 64, 16): (16, 64, 1, 4, 3),
        (128, 64, 64): (32, 64, 1, 8, 4),
    }


@pytest.mark.parametrize(
    "kernel,configs",
    [
        ("gemv", {(96, 256): (4, 128, 4)}),  # a config field short
        ("gemv", {(96, 256, 1): (4, 128, 4, 1)}),  # a key field too many
        ("gemv", {(96, 256): (4, 128, 4, True)}),  # a flag where an int goes
        ("gemv_norm", {(96, 256, False): (4, 128, 4, 1, 1)}),  # an int where a flag goes
        ("gemv", {(96, 0): (4, 128, 4, 1)}),  # not positive
    ],
)
def test_the_writer_refuses_entries_of_the_wrong_shape_or_type(tmp_path, kernel, configs):
    with pytest.raises(ValueError):
        tuning.write(kernel, configs, device_name="Test_GPU", directory=tmp_path)
    assert not (tmp_path / kernel).exists()


def test_a_malformed_file_is_refused_with_its_name(tmp_path):
    file = tmp_path / "gemv" / "device_name=Test_GPU.json"
    tuning.write("gemv", {(96, 256): (4, 128, 4, 1)}, device_name="Test_GPU", directory=tmp_path)
    text = file.read_text()
    for broken in (
        text.replace('"table": "gemv"', '"table": "gemv_norm"'),
        text.replace("[4, 128, 4, 1]", "[4, 128, 4]"),
        text.replace("[4, 128, 4, 1]", "[4, 128, 4, 1.5]"),
        text.replace('"96,256"', '"96,x"'),
    ):
        file.write_text(broken)
        with pytest.raises(ValueError, match=r"device_name=Test_GPU\.json"):
            tuning.read("gemv", file)


def test_unknown_tables_and_writes_for_the_cpu_are_refused(tmp_path):
    with pytest.raises(KeyError, match="no tuning table"):
        tuning.table("gemm")
    with pytest.raises(ValueError, match="measured on a GPU"):
        tuning.write("gemv", {}, device_name=tuning.CPU, directory=tmp_path)
