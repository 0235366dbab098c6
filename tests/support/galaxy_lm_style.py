"""Hand-written configs in Galaxy-LM's style: its keys and layout (train, shape keys, loralib's
switches, init_method, num_iterations, ...), no model_path, small shapes so the random models are
cheap. Shared by test_galaxy_lm_configs.py (loading) and test_readme_commands.py (running)."""

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2}
PEFT_OFF = {"use_lora": False, "use_adapter": False, "use_side": False, "use_side_only": False}
LORALIB = {"lora_alpha": 32, "lora_dropout": 0.1, "fan_in_fan_out": True, "merge_weights": False}
BERT_FULL = {"train": True, "batch_size": 4, "pad_size": 32, **SHAPE, "full_model": True, **PEFT_OFF}
BERT_LORA = {"train": True, "batch_size": 4, "pad_size": 32, **SHAPE, "full_model": False,
             **{**PEFT_OFF, "use_lora": True}, "lora_dim": 8, **LORALIB}
BERT_GALAXY_LORA = {**BERT_LORA, "con_parallel_method": "None", "seq_scatter_list": [20, 12],
                    "att_parallel_method": "TP", "tp_num_attention_heads_list": [2, 2],
                    "mlp_parallel_method": "TP", "tp_intermediate_size_list": [64, 64],
                    "init_method": "tcp://127.0.0.1:23000", "distributed_backend": "gloo"}
BERT_PP_SIDE = {"train": True, "batch_size": 4, "pad_size": 32, **SHAPE, "full_model": False,
                **{**PEFT_OFF, "use_side": True}, "side_reduction_factor": 8, "add_bias_sampling": True,
                "init_method": "tcp://127.0.0.1:23000", "distributed_backend": "gloo",
                "stage_num_hidden_layers_list": [1, 1], "num_microbatches": 1, "num_iterations": 1}
LLAMA_FULL = {"train": True, "device": "cuda", "num_epochs": 3, "batch_size": 4, "pad_size": 10,
              "model_type": "llama", **SHAPE, "type_vocab_size": 2, "vocab_size": 2048, "full_model": True,
              "use_lora": False, "lora_att_dim": 4, **LORALIB, "lora_target_modules": ["q_proj", "v_proj"]}
LLAMA_PP_FULL = {**LLAMA_FULL, "pad_size": 32, "init_method": "tcp://127.0.0.1:23000", "distributed_backend": "gloo",
                 "stage_num_hidden_layers_list": [1, 1], "num_microbatches": 4, "num_iterations": 1}
# Its T5 files hold Hugging Face's T5 config keys (its train_config/t5/pp/full.json, at the shipped
# tiny T5's sizes, pointed at it: a random encoder-decoder needs a tokenizer of the family's) and
# THUCNews' vocabulary and class files; its BART files BART's, num_hidden_layers as BartConfig's
# alias of encoder_layers.
T5_ARCH = {"type_vocab_size": 2, "vocab_size": 2048, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
           "num_decoder_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 32,
           "relative_attention_max_distance": 128, "dropout_rate": 0.1, "classifier_dropout": 0.0,
           "layer_norm_epsilon": 1e-06, "initializer_factor": 1.0, "feed_forward_proj": "relu",
           "decoder_start_token_id": 0, "is_encoder_decoder": True, "pad_token_id": 0, "eos_token_id": 1,
           "return_dict": False, "use_cache": False, "output_attentions": False, "output_hidden_states": False}
T5_PP_FULL = {"model_path": "models/tiny-t5", "vocab_path": "dataset/THUCNews/vocab.txt", "train": True,
              "device": "cuda", "num_epochs": 1, "batch_size": 4, "pad_size": 32, "learning_rate": 5e-5,
              "class_list_path": "dataset/THUCNews/data/class.txt", **T5_ARCH, "full_model": True, **PEFT_OFF,
              "init_method": "tcp://127.0.0.1:23000", "distributed_backend": "gloo",
              "stage_num_hidden_layers_list": [2, 2], "num_microbatches": 4, "num_iterations": 1}
BART_PP_FULL = {"train": True, "device": "cuda", "num_epochs": 1, "batch_size": 16, "pad_size": 128, "d_model": 64,
                "encoder_ffn_dim": 128, "encoder_layers": 3, "encoder_attention_heads": 4, "decoder_ffn_dim": 128,
                "decoder_layers": 3, "decoder_attention_heads": 4, "num_hidden_layers": 3, "full_model": True,
                **PEFT_OFF, "init_method": "tcp://127.0.0.1:23000", "distributed_backend": "gloo",
                "stage_num_hidden_layers_list": [3, 3], "num_microbatches": 1, "num_iterations": 1}
# Galaxy-LM's bart and t5 scripts trained classifiers from their own shape keys.
BART_CLASSIFY = {"train": True, "batch_size": 4, "pad_size": 32, "model_type": "bart", "task": "classification",
                 "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
                 "encoder_ffn_dim": 128, "full_model": True, **PEFT_OFF}
T5_GALAXY_CLASSIFY = {"train": True, "batch_size": 4, "pad_size": 32, "task": "classification", "d_model": 64,
                      "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4, "d_kv": 16, "d_ff": 128,
                      "full_model": True, **PEFT_OFF, "att_parallel_method": "TP", "mlp_parallel_method": "SP",
                      "con_parallel_method": "SP", "tp_num_attention_heads_list": [3, 1],
                      "seq_scatter_list": [20, 12], "decoder_seq_scatter_list": [12, 20],
                      "init_method": "tcp://127.0.0.1:23000", "distributed_backend": "gloo"}
