"""Data: tokenizers, the on-disk token store, preprocessing, and the datasets training reads.

The path from raw text to training batches (after Megatron-LM's data pipeline, Shoeybi et al.
2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism"):

    text files --(tokenizer_training)--> tokenizer.json
    text files --(preprocess)----------> PREFIX.bin + PREFIX.idx      (indexed)
    PREFIX(es) --(gpt_dataset, blend)--> {"input_ids", "labels"} samples of seq_len tokens
"""
