"""T5 ladder side-tuning (Galaxy-LM's finetune_t5_side.py): finetune_t5.py with the side-tuning
config by default: a side encoder and a side decoder beside the frozen T5 (docs/peft.md).

See README.md (docs/models.md); run with --help for the arguments.
"""
from galaxy.inference.finetune_generate import add_greedy_arguments, prepare_encoder_decoder, run_encoder_decoder
from galaxy.launch import main

if __name__ == "__main__":
    main(preset="galaxy", prepare_fn=prepare_encoder_decoder, train_fn=run_encoder_decoder,
         add_arguments=add_greedy_arguments, script="finetune_t5_side.py",
         default_config="train_config/t5/side.json", model_type="t5")
