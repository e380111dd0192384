"""Model loading, prompts, the torch engine, yes/no scoring, evaluation and the CLI."""
