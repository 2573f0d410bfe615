"""Nothing in this directory is a test of the project's own suite (`python -m pytest tests`).

It holds the shim that tools/vllm_kernel_tests.sh loads into a run of vLLM's kernel tests
(hopper_moe_vllm_shim.py needs vLLM installed), the table of skipped upstream tests
(skips.py) and the run's summary script (summarize.py). See README.md.
"""
collect_ignore_glob = ["*"]
