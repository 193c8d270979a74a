"""The media pipeline every vision architecture shares: decode (Pillow, with size and format
checks), preprocess (resize, rescale, normalise with the checkpoint's processor constants), and
placeholder expansion (each image becomes its exact number of image tokens in prompt order)."""
