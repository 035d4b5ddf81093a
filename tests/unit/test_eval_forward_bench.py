"""``benchmarks/eval_forward.py --quick`` on a tiny Llama in bfloat16: both formats, the three forwards
timed, and the bfloat16 path really on (the kernels' cast checked) while the float32-copy forward restores
it afterwards."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import eval_forward  # the benchmark script

from modelopt_lite.formats.kernels import native

from .test_native_fake_quant import needs_compiler


@needs_compiler
def test_quick_run_times_the_three_forwards_of_each_format(tmp_path: Path) -> None:
    out_file = tmp_path / "out.json"
    threads = torch.get_num_threads()
    with mock.patch.dict(os.environ):  # (the script pins threads and quiets transformers for its process)
        try:
            out = eval_forward.main(["--quick", "--threads", "1", "--json", str(out_file)])
        finally:
            torch.set_num_threads(threads)
    assert json.loads(out_file.read_text())["rows"].keys() == {"nvfp4", "fp8"}
    for row in out["rows"].values():
        assert row["bf16_io_available"]
        assert row["seconds"].keys() == {"unquantized", "bf16 io", "float32 copy"}
        assert row["ratio_to_unquantized"]["unquantized"]["min"] == 1.0
        assert all(s["min_s"] > 0 for s in row["seconds"].values())
    assert native._state["nan16"] is not None  # put back after the float32-copy forwards
