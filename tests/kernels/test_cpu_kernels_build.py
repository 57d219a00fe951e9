"""Where and under what name the compiled CPU kernels are built: once per install and source
version, so two checkouts or an upgrade never rebuild over each other at every switch."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels.cpu_kernels import _SOURCES, build_directory, module_name


def test_the_name_follows_the_sources_flags_and_instruction_set(tmp_path: Path) -> None:
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }\n")
    b.write_text("int g() { return 2; }\n")
    base = module_name("AVX512", ["-O3"], [a, b])
    assert base == module_name("AVX512", ["-O3"], [a, b])  # stable: the same build finds its cache
    assert base.startswith("loom_cpu_kernels_avx512_")
    assert module_name("AVX2", ["-O3"], [a, b]) != base
    assert module_name("AVX512", ["-O2"], [a, b]) != base
    b.write_text("int g() { return 3; }\n")  # another checkout's sources
    assert module_name("AVX512", ["-O3"], [a, b]) != base


def test_the_shipped_sources_all_take_part() -> None:
    assert all(s.is_file() for s in _SOURCES)


def test_it_is_built_inside_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert (
        build_directory("loom_x", prefix=str(tmp_path)) == tmp_path / "share" / "loom" / "kernels" / "loom_x"
    )
    assert (tmp_path / "share" / "loom" / "kernels" / "loom_x").is_dir()


def test_torch_s_own_folder_wins_when_the_user_chose_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert build_directory("loom_x", prefix=str(tmp_path)) is None


def test_an_unwritable_prefix_falls_back_to_torch_s_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert build_directory("loom_x", prefix=str(blocked)) is None
