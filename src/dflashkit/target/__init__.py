"""The frozen target model: its files (`files`), loading (`load`: HF dir, GGUF, wrapped configs, the layer taps),
quantized checkpoints (`quantized`), recurrent layers (`hybrid`), the embedding and head read alone (`head`),
CPU-packed linear layers (`packed`), the growing decode KV cache (`kv_cache`) and the tiny targets built in code
(`tiny`). The drafter networks it feeds live in `dflashkit.model`; nothing here imports them.
"""
