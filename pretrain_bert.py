"""BERT sequence classification, serial (one process). See README.md; run with --help for the arguments."""
from galaxy.launch import main
from galaxy.train.trainer import prepare_classifier, train_classifier

if __name__ == "__main__":
    main(preset="serial", prepare_fn=prepare_classifier, train_fn=train_classifier, script="pretrain_bert.py",
         default_config="train_config/bert/full.json", model_type="bert")
