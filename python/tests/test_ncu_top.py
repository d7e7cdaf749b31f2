"""scripts/ncu_top.py on a synthetic ncu source-page CSV (no GPU): the header found below ncu's
kernel-name row, samples and executions summed by opcode (predicated ones by their guard), the
instructions ranked by samples, and the usage message without an argument."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ncu_top.py"

CSV = '''"Kernel Name","void k(int)",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed"
"0x7f0000000010","      MOV R1, c[0x0][0x28]","10","5","10","128"
"0x7f0000000020","      @P0 BRA 0x7f0000000010","30","5","30","1,280"
"0x7f0000000030","      HGMMA.64x32x16.F32.BF16 R24, gdesc[UR12], R24, gsb0","50","40","50","512"
"0x7f0000000040","      MOV R2, R3","10","0","10","80"
'''


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_ncu_top_ranks_and_sums(tmp_path):
    f = tmp_path / "rep.csv"
    f.write_text(CSV)
    r = run(str(f))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "instructions 4 samples 100.0" in out
    # by opcode: HGMMA 50%, the guarded branch 30%, the two MOVs 20% together
    assert "50.0%  HGMMA.64x32x16.F32.BF16" in out
    assert "30.0%  @P0 BRA" in out
    assert "20.0%  MOV" in out
    # executions: 128 + 1280 + 512 + 80 = 2000 (the thousands separator read)
    assert "total 2000" in out
    assert "64.0%        1280  @P0 BRA" in out
    # the top instruction first, with its address and executions
    top = out.split("top 40 instructions:")[1].strip().splitlines()
    assert top[0].split()[0] == "50.0%" and "0x7f0000000030" in top[0] and "512" in top[0]
    assert len(top) == 4


def test_ncu_top_usage():
    r = run()
    assert r.returncode != 0
    assert "ncu --kernel-name" in r.stderr
