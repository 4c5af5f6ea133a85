"""How the model is parallel, decided once by the plan (parallelism: DDP's settings or FSDP2's, and
float8's), FSDP2's sharding of a recipe's model (sharding), the optimizer's step on local shards
(shard_optimizer), float8 matmuls through torchao with what a step runs first and last for FSDP2's
float8 all-gather (float8: ``train.float8``), and that all-gather's weight cast, once a step rather
than once a gather (float8_cast). The one place in trainer/ that asks whether a model is sharded;
checkpoints ask the plan's ``Parallelism`` (trainer/checkpoint/choice.py).
"""
