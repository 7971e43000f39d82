"""scripts/gpu/diffusion_gemma_engine.py's switches: --kernel NAME=BOOL over the backend's kernel
choice, --xla-option KEY=VALUE; a bad one is argparse's one-line error (exit status 2)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dllm_jax.runtime.kernel_routing import Kernels, resolve_kernels
from scripts.gpu.diffusion_gemma_engine import kernel_switch, main, xla_option


def test_a_kernel_switch_names_a_kernels_field_and_a_bool():
    assert kernel_switch("moe_output=true") == ("moe_output", True)
    assert kernel_switch("canvas_scatter=False") == ("canvas_scatter", False)
    switched = dataclasses.replace(resolve_kernels("xla"), **dict([kernel_switch("head_norm=true")]))
    assert switched == Kernels(head_norm=True)
    for bad in ("moe_output", "moe_output=1", "triton=true", "interpret=true", "fp8_fused_qkv_rows=true"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=true|false"):
            kernel_switch(bad)


def test_an_xla_option_parses_its_value():
    assert xla_option("xla_gpu_dot_merger_threshold_mb=0") == ("xla_gpu_dot_merger_threshold_mb", 0)
    assert xla_option("xla_gpu_enable_triton_gemm=false") == ("xla_gpu_enable_triton_gemm", False)
    assert xla_option("xla_gpu_enable_command_buffer=FUSION") == ("xla_gpu_enable_command_buffer", "FUSION")


def test_a_bad_switch_is_a_one_line_error_with_exit_status_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--tiny", "--kernel", "moe_out=true"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--kernel" in err and "'moe_out=true'" in err and "moe_output" in err
