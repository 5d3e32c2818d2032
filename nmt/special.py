"""Special token ids shared by the tokenizer, the data pipeline, the models and the search."""

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
