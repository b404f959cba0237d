from pipeline.cli import end, main

end(main())
