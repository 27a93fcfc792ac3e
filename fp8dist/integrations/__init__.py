"""Hand-overs to other people's trainers (Hugging Face Trainer, Accelerate, Ray Train); each imports its own library."""
