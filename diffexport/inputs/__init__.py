"""Token ids a model is fed from outside an artifact: a text file through its tokenizer (or as
bytes), the seeded synthetic streams (`streams`), and the needle-retrieval task's documents
(`needle_task`). Calibration (passes), perplexity (validation), the analysis tools and training
read them from here."""
