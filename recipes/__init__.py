"""Demo recipes for tinkerq: a tiny model, a tokenizer and a small SFT data set."""
