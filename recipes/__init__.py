"""Recipes: what is trained (model, data, preprocessing, loss, and how a trained model is
written out where it has a format of its own), nothing else.

Each recipe module (mnist, cifar10, gpt, hf_causal_lm) has ``build(cfg, runtime) ->
trainer.recipe.Recipe``, named by its config's ``_target_`` (conf/recipe/<name>.yaml). The
trainer keeps no list of them: a recipe in your own package is reached the same way. The
other modules are what recipes share: image folders (image_folder, image_crops), the image recipes'
helpers (vision), token files (tokens) and seeded subsets of real data (subset).
hf_causal_lm also holds the one writer of save_pretrained directories (its checkpoint.export,
scripts/export_hf.py and scripts/bench_pretrained.py write through it).
"""
