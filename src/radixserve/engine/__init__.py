"""Engine side: model runner, sampler, detokenizer and the public Engine."""
