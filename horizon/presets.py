"""Named model sizes: `tiny` (tests), `small` (CPU benchmarks), `k3` (Kimi K3 as released; alias `2.8t`).

`ModelConfig.preset(name)` builds a config from these. Every number that the seeds do not give is a
choice; the choices for `2.8t` and why are written next to them. `horizon plan --preset 2.8t`
counts the parameters from a meta-device model built from exactly this dictionary.
"""

# Runs the whole test suite on 2 CPU cores in seconds. Six layers give two Gated DSA layers
# (4 and 6) among four KDA layers; index_topk=16 is far below the test prompts so the sparse
# selection is exercised; 8 index heads (the floor in docs/design.md §1.2); group-limited routing is on.
_TINY = dict(
    vocab_size=4096, hidden_size=64, num_layers=6, first_k_dense=1, intermediate_size=128,
    max_position_embeddings=8192,
    kda_num_heads=2, kda_head_dim=32,
    num_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, dsa_gate_rank=16,
    index_n_heads=8, index_head_dim=16, index_topk=16,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    n_group=2, topk_group=1, routed_scaling_factor=1.0,
    # a 2-layer ViT: 8-px patches merged 2x2, so one image token per 16x16 pixels, at most 64
    vision_layers=2, vision_hidden_size=64, vision_num_heads=4, vision_intermediate_size=128,
    vision_patch_size=8, vision_merge=2, vision_max_tokens=64,
)

PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    # The bundled trained model (horizon-tiny): tiny's six-layer schedule, twice the width, 4.2M
    # parameters, trainable on 2 CPU cores in under an hour; index_topk 64, so a 256-token prompt
    # already runs sparse (the passkey task is measured at 4x index_topk).
    "mini": dict(
        _TINY,
        hidden_size=128, intermediate_size=512, max_position_embeddings=4096, kda_head_dim=64,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        dsa_gate_rank=32, index_head_dim=32, index_topk=64, moe_intermediate_size=128,
    ),
    # A CPU benchmark size: ~0.6B total / ~0.1B active. Full-size top_k (2048), so contexts above
    # 2K really run sparse.
    "small": dict(
        vocab_size=32768, hidden_size=512, num_layers=12, first_k_dense=1, intermediate_size=2048,
        max_position_embeddings=131072, dtype="bfloat16",
        kda_num_heads=8, kda_head_dim=64,
        num_heads=8, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, dsa_gate_rank=64,
        index_n_heads=8, index_head_dim=64, index_topk=2048,
        n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=512, n_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.0,
        vision_layers=4, vision_hidden_size=256, vision_num_heads=4, vision_intermediate_size=1024,
        vision_patch_size=14, vision_merge=2, vision_max_tokens=256,
    ),
    # The seeds' model: 93 layers (24 Gated DSA + 69 KDA by the every-4th-and-last schedule),
    # top_k 2048, a 1,048,576-token context, ~2.8T total / ~104B active parameters.
    # Given by the seeds: layer counts, top_k, context, the two totals. Chosen here:
    #  * hidden 7168, vocab 163,840, MLA dims (q latent 1536, kv latent 512, nope 128, rope slice 64,
    #    v 128) and indexer dims (64 heads x 128) as in the DeepSeek-V3 / Kimi family the seeds'
    #    model descends from (Kimi Linear's MLA layers are DeepSeek-V3's); 64 attention heads as in
    #    Kimi K2 (its DSA layers are a quarter of the stack, so fewer heads than DeepSeek's 128).
    #  * KDA: 64 heads x 128 (Kimi Linear's head dim; heads x dim > hidden as in Kimi Linear).
    #  * one dense first layer (Kimi's first_k_dense_replace=1) of width 18432 (DeepSeek-V3's).
    #  * MoE: with everything above fixed, the routed experts must hold ~2.77T parameters and a
    #    token must touch ~72B of them. Expert width 2304 with 608 routed experts (8 groups of 76,
    #    4 groups kept, DeepSeek-style), 16 routed + 2 shared per token meets both totals to
    #    within 0.5%; `horizon plan --preset 2.8t` prints the counts from the built modules.
    #  * no rotary embedding in MLA (KDA carries position); routed_scaling_factor 2.5 (DeepSeek).
    #  * vision: a SigLIP-so400m-sized ViT (27 layers, 1152 wide, 16 heads, MLP 4304; ~0.4B, as
    #    Kimi's MoonViT), 14-px patches merged 2x2 (one token per 28x28 pixels), up to 4096 tokens
    #    per image (a 1792x1792 screenshot at full resolution).
    # Kimi K3 as released (moonshotai/Kimi-K3; shapes from its config.json and safetensors index, as the
    # public engines read them): 93 layers, MLA (no RoPE, no indexer, a full-rank output gate) at 4, 8, ...,
    # 92 and 93, K3's KDA (96 heads x 128, decay bounded below by -5, full-rank gate) elsewhere; attention
    # residuals in blocks of 12; a dense SiTU layer 0 33792 wide; then latent MoE: 896 SiTU experts of
    # width 3072 on a 3584-wide latent (RMS-normed after the combine), top-16 by a sigmoid router with no
    # groups, plus 2 shared experts at full width. Text only here: K3's vision tower (MoonViT) is not
    # Horizon's encoder. `horizon plan --preset k3`: 2.779T total / 105.4B active.
    "k3": dict(
        vocab_size=163840, hidden_size=7168, num_layers=93, first_k_dense=1, intermediate_size=33792,
        max_position_embeddings=1048576, rms_norm_eps=1e-5, dtype="bfloat16", hidden_act="situ",
        situ_beta=4.0, situ_linear_beta=25.0, attn_res_block_size=12,
        kda_num_heads=96, kda_head_dim=128, kda_gate_lower_bound=-5.0, kda_gate_full_rank=True,
        num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_norm_eps=1e-6, dsa_gate_rank=0, dsa_gate_full_rank=True,
        index_n_heads=0, index_head_dim=0, index_topk=0,
        n_routed_experts=896, num_experts_per_tok=16, moe_intermediate_size=3072, n_shared_experts=2,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, moe_latent_size=3584, moe_latent_norm=True,
        vision_layers=0,
    ),
    # The articles' own guess at the model before K3's release (kept for comparison; `2.8t-articles`).
    "2.8t-articles": dict(
        vocab_size=163840, hidden_size=7168, num_layers=93, first_k_dense=1, intermediate_size=18432,
        max_position_embeddings=1048576, dtype="bfloat16",
        kda_num_heads=64, kda_head_dim=128,
        num_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, dsa_gate_rank=128,
        index_n_heads=64, index_head_dim=128, index_topk=2048,
        n_routed_experts=608, num_experts_per_tok=16, moe_intermediate_size=2304, n_shared_experts=2,
        n_group=8, topk_group=4, routed_scaling_factor=2.5,
        vision_layers=27, vision_hidden_size=1152, vision_num_heads=16, vision_intermediate_size=4304,
        vision_patch_size=14, vision_merge=2, vision_max_tokens=4096,
    ),
}
PRESETS["2.8t"] = PRESETS["k3"]  # the articles' name for the model, now the released shapes
