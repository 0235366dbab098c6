"""BART sequence-to-sequence fine-tuning with pipeline parallelism (pp_deg = world unless the config
says; stages split the encoder's layers, then the decoder's).

See README.md (docs/models.md); run with --help for the arguments.
"""
from galaxy.launch import main
from galaxy.train.trainer import prepare_seq2seq, train

if __name__ == "__main__":
    main(preset="pp", prepare_fn=prepare_seq2seq, train_fn=train, script="finetune_pp_bart.py",
         default_config="train_config/bart/pp/full.json", model_type="bart")
