"""GGUF files of transformers models: the file (:mod:`.export`), each architecture's names and metadata
(:mod:`.arch`), the run's records per parameter (:mod:`.records`), the embedding and head (:mod:`.edges`), the
tokenizer (:mod:`.vocab`) and the file written while a run goes (:mod:`.stream`)."""
