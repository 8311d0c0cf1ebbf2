"""Stage 5, the DFlash drafter.

- `model`: the drafter (Qwen3-style layers fed the target's hidden states), its config and checkpoint layout;
- `loss`: the anchored-block cross-entropy with position weights;
- `data`: training batches from hidden-state caches or online from samples;
- `training`: the training loop (AdamW, warm-up, cosine, budget, learning-curve checkpoints);
- `state`: resumable training state on disk;
- `recipe`: a training run's definition and result;
- `decoding`: speculative decoding, acceptance length and decode speed;
- `graph_decoding`: the same at batch 1 as a server runs it (static caches, CUDA graphs) and its decode speed;
- `stages`: the stages over the store (recipes, training a checkpoint, evaluating it);
- `provenance`: what made a checkpoint, published beside it;
- `serving_match`: a checkpoint against what SGLang's DFlash loader and the served target expect;
- `decontamination`: evaluation and benchmark prompts against the trained shards.
"""
