def convert_gguf(gguf_path, out_dir):
    raise NotImplementedError
