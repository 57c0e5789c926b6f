"""Media inputs: images, audio and video turned into prompt placeholders and the encoders' soft tokens.

    items.py            a request's media items (where they sit in the prompt, what the encoder takes)
    images.py, audio.py, video.py   decoding and preprocessing per modality (limits, clips, frames)
    encoder_cache.py    soft tokens by content, kept across a prompt's chunks and shared between requests
    embedder.py         the runner's side: each request's items, their soft tokens put into a step's embeddings
"""
