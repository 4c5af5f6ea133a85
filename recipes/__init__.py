"""Recipes: what is trained (model, data, preprocessing, loss), nothing else.

Each recipe module has ``build(cfg, runtime) -> trainer.recipe.Recipe``, named by its
config's ``_target_`` (conf/recipe/<name>.yaml). The trainer keeps no list of them: a
recipe in your own package is reached the same way.
"""
