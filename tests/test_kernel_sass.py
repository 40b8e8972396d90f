"""tools/kernel_sass.py's reading of ptxas's report and of a SASS listing (text only: no GPU)."""

from tools import kernel_sass

LOG = """
ptxas info    : Compiling entry function 'mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mosaic_gpu_kernel
    8 bytes stack frame, 16 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 232448 bytes smem
        /*0a90*/                   FFMA R12, R13, R14, R12 ;
        /*0aa0*/              @!P0 FFMA R15, R13, R16, R15 ;
        /*0ab0*/                   HGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
        /*0ac0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0ad0*/             @UPT  STL.64 [R1+0x8], R2 ;
        /*0ae0*/                   FMUL.FTZ R3, R3, R4 ;
"""


def test_ptxas_report_gives_registers_and_spills():
  assert kernel_sass.ptxas_resources(LOG) == {"registers": 168, "spill_stores_bytes": 16, "spill_loads_bytes": 24}


def test_opcodes_are_counted_without_their_modifiers_or_predicates():
  r = kernel_sass.summarize(LOG)
  assert r["instructions"] == 6
  assert {op: r["watched"][op] for op in ("FFMA", "HGMMA", "WARPGROUP", "STL", "FMUL", "LDL")} == {
      "FFMA": 2, "HGMMA": 1, "WARPGROUP": 1, "STL": 1, "FMUL": 1, "LDL": 0}


def test_a_log_without_a_report_says_so():
  assert kernel_sass.ptxas_resources("no ptxas here")["registers"] is None
