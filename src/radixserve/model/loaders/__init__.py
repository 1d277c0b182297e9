"""Reading model files: GGUF containers and loaders, Hugging Face folders and their weights, models shipped as packages."""
