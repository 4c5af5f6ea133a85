"""What several scripts share: launching runs (launch) and ending every process of one (process_tree), their
comparison (comparison) and loss curves laid over each other (loss_plot), timing a built trainer's steps with
train.py's timer (timing), reading a profiled step's kernels (kernel_profile) and memory pools (memory_pools),
the GPU's energy, power and clock over timed steps (gpu_power), refusing bad input with the config-error
exit code (refuse), the all-reduce model (allreduce_model); and what a script runs apart from its command
line: the Llama 3 shapes and FLOP formula of bench_torchtitan (llama3) and its torchtitan side, which
torchrun starts as a module (torchtitan_worker); bench_trl's conversations, tokenizer and model directories
(chat_data) and its TRL side (trl_worker). A package of its own because every scripts/*.py is a
command line (tests/test_scripts.py asks each for --help) and these modules are not.
"""
