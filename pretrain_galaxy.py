"""BERT sequence classification, any per-sub-block plan from the config (ATT, CON, MLP methods). See README.md; run with --help for the arguments."""
from galaxy.launch import main
from galaxy.train.trainer import prepare_classifier, train_classifier

if __name__ == "__main__":
    main(preset="galaxy", prepare_fn=prepare_classifier, train_fn=train_classifier, script="pretrain_galaxy.py",
         default_config="train_config/bert/galaxy/full.json", model_type="bert")
