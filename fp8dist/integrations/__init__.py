"""Hand-overs to other people's trainers (Hugging Face Trainer, Accelerate, Ray Train): one module each."""
