"""Every shipped kernel configuration compiles with NVRTC (no GPU needed) with zero spills."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from persistent_rnn import kernel_report, kernels
from persistent_rnn.cells import CELLS
from persistent_rnn.plan import SHIPPED, resident_ctas, tiles_for

FORWARD_DEFINES = {"PRNN_CELL": 0, "PRNN_UNITS": 4, "PRNN_ROWS": 4, "PRNN_KSPLIT": 4,
                   "PRNN_KPT": 1, "PRNN_WARPS": 4}


@pytest.fixture(scope="module")
def records():
    return kernel_report.kernel_records(("sm_80", "sm_90"))


def test_every_configuration_is_reported(records):
    expected = sum(len(tiles_for(c)) for c in CELLS.values()) * 2 * 2
    assert len(records) == expected
    for cell in CELLS:
        for pass_ in ("forward", "backward"):
            for arch in ("sm_80", "sm_90"):
                mine = [r for r in records if (r["cell"], r["pass"], r["arch"]) == (cell, pass_, arch)]
                assert len(mine) == len(tiles_for(CELLS[cell]))


def test_zero_spills_and_registers_within_plan(records):
    for r in records:
        assert r["spill_bytes"] == 0, r
        assert 0 < r["registers"] <= r["planned_registers"], r
        # What the GPU's occupancy calculator will say: one CTA of this block fits an SM.
        assert resident_ctas(r["block"], r["registers"]) >= 1, r
        # The weights really are in registers: there are more registers than weights.
        assert r["registers"] > r["weights_per_thread"], r


def test_largest_tiles_use_most_of_the_register_file(records):
    for cell, tiles in SHIPPED.items():
        for pass_ in ("forward", "backward"):
            biggest = max(r["block"] * r["weights_per_thread"] for r in records
                          if r["pass"] == pass_ and r["cell"].startswith(cell[:3]))
            assert biggest >= 0.7 * 65536, (cell, pass_)


def test_cli_json(capsys):
    assert kernel_report.main(["--arch", "90", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["arch"] for r in out} == {"sm_90"}
    assert {"cell", "pass", "arch", "config", "hidden_size", "registers", "spill_bytes",
            "shared_bytes", "planned_registers"} <= set(out[0])


def test_compile_error_raises_with_log():
    with pytest.raises(RuntimeError, match="PRNN_CELL") as info:
        kernels.compile_source("persistent_forward.cu", {"PRNN_UNITS": 4}, "sm_90")
    assert "error" in str(info.value)


def _elf_extent(image: bytes) -> int:
    """Where the last of an ELF64's header tables and file-backed sections ends."""
    assert image[:4] == b"\x7fELF" and image[4] == 2, "not an ELF64 image"
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
    for i in range(shnum):
        _, kind, _, _, offset, size = struct.unpack_from("<IIQQQQ", image, shoff + i * shentsize)
        if kind != 8:  # SHT_NOBITS occupies no bytes of the file
            ends.append(offset + size)
    return max(ends)


def _cuobjdump() -> str | None:
    """cuobjdump on PATH or from the nvidia-cuda-cuobjdump wheel (the ``test`` extra)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for candidate in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(candidate)
    return None


def test_cached_cubin_is_a_complete_elf(tmp_path, monkeypatch):
    monkeypatch.setenv("PRNN_CACHE_DIR", str(tmp_path))
    compiled = kernels.compile_source("persistent_forward.cu", FORWARD_DEFINES, "sm_90")
    image = compiled.cubin_path.read_bytes()
    assert _elf_extent(image) == len(image)
    tool = _cuobjdump()
    if tool is None:
        return  # the ELF check above already fails on an image one byte short
    listing = subprocess.run([tool, "-elf", str(compiled.cubin_path)], capture_output=True,
                             text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    assert "prnn_persistent_forward" in listing.stdout
