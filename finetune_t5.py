"""T5 sequence-to-sequence fine-tuning (serial, any Galaxy plan, dp_deg mesh) from the config.

See README.md (docs/models.md); run with --help for the arguments.
"""
from galaxy.launch import main
from galaxy.train.trainer import prepare_seq2seq, train

if __name__ == "__main__":
    main(preset="galaxy", prepare_fn=prepare_seq2seq, train_fn=train, script="finetune_t5.py",
         default_config="train_config/t5/full.json", model_type="t5")
