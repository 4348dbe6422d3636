"""What several benchmark tests share."""

# Small enough to time in well under a second per point on CPU; a short context so that one point cannot fit.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,  # the default blend checks layers 1..3
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=160,
)
