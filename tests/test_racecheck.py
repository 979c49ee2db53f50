"""bench/racecheck.py without a GPU: the verdicts on a real racecheck log (H100, 2026-11-26) against
the SASS of the cubins that ran, a doctored pair rejected, and the rules still finding the
exchange's poll and DSMEM store in the kernels the current source compiles to."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "racecheck_fixture"
sys.path.insert(0, str(ROOT / "bench"))
import racecheck  # noqa: E402

sys.path.remove(str(ROOT / "bench"))

# The source lines the fixture's line table names, as they read when it was made (cuda_src/hw.cuh:
# prnn_store_cluster_u32, prnn_load_shared_relaxed_u32; a partial-sum read; a pointwise store).
LINES = {
    ("hw.cuh", 193): 'asm volatile("st.relaxed.cluster.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(v) : "memory");',
    ("hw.cuh", 219): 'asm volatile("ld.relaxed.cluster.shared::cta.u32 %0, [%1];" : "=r"(v) : "r"(p));',
    ("persistent_common.cuh", 661): "for (int c = First; c < Last; ++c) s += part_s[(b * Ksplit + c) * local_rows + row];",
    ("persistent_forward.cu", 133): "y[row * hidden + j] = hp_s[own] = h;",
}


def fixture_line(file: str, line: int) -> str:
    return LINES[(Path(file).name, line)]


def fixture_code() -> dict:
    return racecheck.instructions((FIXTURE / "cluster-fp32-gru.sass").read_text())


def test_the_real_log_holds_only_deliberate_pairs():
    log = (FIXTURE / "cluster-fp32-gru.log").read_text()
    races, other = racecheck.parse_races(log)
    assert not other
    assert len(races) == 24 and sum(r.hazards for r in races) == 9104
    assert races[0] == racecheck.Race(racecheck.Access("Read", "prnn_persistent_forward", 0x3280),
                                      racecheck.Access("Write", "prnn_persistent_forward", 0x4eb0), 944)
    findings, deliberate = racecheck.case_verdicts(log, fixture_code(), fixture_line)
    assert (findings, deliberate) == ([], 24)
    assert racecheck.case_outcome("cluster-fp32-gru", log, 0) is None


@pytest.mark.parametrize("doctored, why", [
    ("prnn_persistent_forward+0x4f50", "STS, persistent_forward.cu:133, not the exchange"),
    ("prnn_persistent_forward+0x48a0", "LDS, persistent_common.cuh:661, not the exchange"),
    ("prnn_persistent_forward+0x4f60", "no such instruction"),
])
def test_a_doctored_write_is_a_finding(doctored, why):
    """A write that is not a DSMEM store (an STS; a load; an offset the cubin lacks) fails."""
    log = (FIXTURE / "cluster-fp32-gru.log").read_text().replace(
        "Write access at prnn_persistent_forward+0x4ee0 [976 hazards]",
        f"Write access at {doctored} [976 hazards]")
    findings, deliberate = racecheck.case_verdicts(log, fixture_code(), fixture_line)
    assert deliberate == 23 and len(findings) == 1
    assert findings[0].startswith("NOT DELIBERATE (976 hazards): ")
    assert doctored in findings[0] and why in findings[0]


def test_swapped_roles_and_unknown_lines_are_findings():
    log = (FIXTURE / "cluster-fp32-gru.log").read_text()
    swapped = log.replace("Read access at prnn_persistent_forward+0x3280",
                          "Write access at prnn_persistent_forward+0x3280")
    assert len(racecheck.case_verdicts(swapped, fixture_code(), fixture_line)[0]) == 3
    odd = log.replace("=========     and Write access at prnn_persistent_forward+0x4ef0 [976 hazards]",
                      "=========     and Write access at prnn_persistent_forward+0x4ef0")
    findings, _ = racecheck.case_verdicts(odd, fixture_code(), fixture_line)
    assert findings == ["unrecognised sanitizer report: and Write access at "
                        "prnn_persistent_forward+0x4ef0"]
    # a kernel whose cubin the case did not list: nothing to classify against
    assert "no such instruction" in racecheck.case_verdicts(log, {}, fixture_line)[0][0]


def test_a_kernel_in_two_cubins_matters_only_where_races_were_reported(monkeypatch):
    """A case may load one kernel from two cubins (the completion kernels of an fp16 and an fp32
    pass: the H200 run of 2026-11-27's grid-fp16-gru). With no race reported there is nothing
    to tell apart; with a race, its offset names no one instruction: a finding."""
    monkeypatch.setattr(racecheck, "cubins_of", lambda output: ["a.cubin", "b.cubin"])
    monkeypatch.setattr(racecheck, "disassemble_with_lines", lambda cubin: cubin)
    monkeypatch.setattr(racecheck, "instructions", lambda sass: {"prnn_complete_forward": {}})
    clean = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert racecheck.case_verdicts(clean) == ([], 0)
    log = (FIXTURE / "cluster-fp32-gru.log").read_text()
    assert "kernel prnn_complete_forward is in two cubins the case loaded" in \
        racecheck.case_verdicts(log)[0]


def test_the_case_outcome_names_a_failed_or_unfinished_case():
    log = (FIXTURE / "cluster-fp32-gru.log").read_text()
    assert racecheck.case_outcome("cluster-fp32-gru", log, None) == "timed out"
    assert racecheck.case_outcome("cluster-fp32-gru", log, 1) == "exit 1, result ok"
    failed = log.replace("cluster-fp32-gru: ok", "cluster-fp32-gru: forward ran gemm")
    assert racecheck.case_outcome("cluster-fp32-gru", failed, 0) == "exit 0, result forward ran gemm"


@pytest.fixture(scope="module")
def cluster_cubins(tmp_path_factory):
    """The cluster-fp32-gru forward kernel compiled here with and without PRNN_LINEINFO."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from persistent_rnn import kernels, plan, sass_analysis
    if sass_analysis.nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    forward = plan.make_plan("gru", 40, 2, "float32", "h100").forward
    assert "PRNN_CLUSTER" in forward.defines
    mp = pytest.MonkeyPatch()
    mp.setenv("PRNN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        cubins = {}
        for lineinfo in ("0", "1"):
            mp.setenv(kernels.LINEINFO_ENV, lineinfo)
            cubins[lineinfo] = kernels.compile_source(forward.source, forward.defines, "sm_90").cubin_path
    finally:
        mp.undo()
    return cubins


def test_lineinfo_leaves_the_sass_unchanged(cluster_cubins):
    from persistent_rnn import sass_analysis
    plain, lined = (sass_analysis.disassemble(cluster_cubins[k], sass_analysis.nvdisasm())
                    for k in ("0", "1"))
    assert plain == lined and cluster_cubins["0"] != cluster_cubins["1"]


def test_the_rules_find_the_exchange_in_the_current_source(cluster_cubins):
    """The poll and the DSMEM store are found by their PTX in today's cuda_src; a race between
    them passes, one between the poll and any other store fails."""
    code = racecheck.instructions(racecheck.disassemble_with_lines(cluster_cubins["1"]))
    insns = code["prnn_persistent_forward"]
    roles = {off: racecheck.role(ins) for off, ins in insns.items()}
    polls = [off for off, r in roles.items() if r == "poll"]
    stores = [off for off, r in roles.items() if r == "dsmem store"]
    others = [off for off, ins in insns.items() if ins.opcode.startswith("STS")]
    assert polls and stores and others
    assert all(insns[off].opcode.startswith("LDS") for off in polls)
    assert all(insns[off].opcode.startswith("ST.") for off in stores)

    def race(write: int) -> racecheck.Race:
        return racecheck.Race(racecheck.Access("Read", "prnn_persistent_forward", polls[0]),
                              racecheck.Access("Write", "prnn_persistent_forward", write), 1)
    assert racecheck.verdict(race(stores[0]), code) is None
    assert "not the exchange" in racecheck.verdict(race(others[0]), code)
    # without a line table nothing is the exchange
    bare = {k: {o: dataclasses.replace(i, file=None, line=None) for o, i in v.items()}
            for k, v in code.items()}
    assert racecheck.verdict(race(stores[0]), bare) is not None


def test_lineinfo_setting_is_checked(monkeypatch):
    from persistent_rnn import kernels
    monkeypatch.setenv(kernels.LINEINFO_ENV, "yes")
    with pytest.raises(ValueError, match="PRNN_LINEINFO must be 0 or 1"):
        kernels.lineinfo_requested()
    monkeypatch.setenv(kernels.LINEINFO_ENV, "1")
    assert kernels.lineinfo_requested()
    assert "-lineinfo" in kernels.compile_options({}, "sm_90", lineinfo=True)
    assert "-lineinfo" not in kernels.compile_options({}, "sm_90")


def test_a_log_with_line_tables_names_inlined_functions_and_lines():
    """With PRNN_LINEINFO=1 racecheck names the inlined device function and the source line
    (``prnn_load_shared_relaxed_u32(unsigned int)+0x3280 in hw.cuh:219``; the H100 run of
    2026-11-26): the same pairs are found in the kernels the case loaded and are deliberate; a
    write on another line, or on a line that is not the exchange's, is a finding."""
    log = (FIXTURE / "cluster-fp32-gru-lineinfo.log").read_text()
    races, other = racecheck.parse_races(log)
    assert not other and len(races) == 24
    assert races[0].first == racecheck.Access(
        "Read", "prnn_load_shared_relaxed_u32(unsigned int)", 0x3280, "hw.cuh", 219)
    assert (races[0].second.offset, races[0].second.line) == (0x4eb0, 193)
    assert racecheck.case_verdicts(log, fixture_code(), fixture_line) == ([], 24)
    wrong_line = log.replace("+0x4ee0 in hw.cuh:193 [944", "+0x4ee0 in hw.cuh:219 [944", 1)
    assert wrong_line != log
    findings, deliberate = racecheck.case_verdicts(wrong_line, fixture_code(), fixture_line)
    assert deliberate == 23 and len(findings) == 1
    not_exchange = log.replace("prnn_store_cluster_u32(unsigned int *, int, unsigned int)+0x4ee0 in "
                               "hw.cuh:193 [944", "prnn_forward_step+0x4f50 in persistent_forward.cu:133 [944",
                               1)
    assert not_exchange != log
    findings, deliberate = racecheck.case_verdicts(not_exchange, fixture_code(), fixture_line)
    assert deliberate == 23 and "not the exchange" in findings[0]
